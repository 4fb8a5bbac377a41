# The spotagent AMI: a deep-learning base AMI plus the agent in its own virtualenv, its systemd
# unit (enabled), a default config and the IAM policy document.
#
# Build on AWS (modern Packer, see plugins.pkr.hcl):
#   make wheelhouse && packer build -only=amazon-ebs.spotagent -var region=us-east-1 packer/
# Build on Debian's Packer 1.6.6 (Amazon builder built in; name this file, not the directory):
#   make wheelhouse && packer build -only=amazon-ebs.spotagent -var region=us-east-1 packer/spotagent.pkr.hcl
# Build without AWS: the same provisioning over SSH into any machine (CI: a booted
# systemd-nspawn container, `make test-slow`; see docs/systemd-tier.md):
#   packer build -only=null.local -var local_host=HOST -var local_port=22 \
#     -var local_key_file=KEY packer/spotagent.pkr.hcl
# Validate with Debian's Packer 1.6.6:
#   packer validate -syntax-only packer/spotagent.pkr.hcl

variable "region" {
  type    = string
  default = "us-east-1"
}

variable "instance_type" {
  type    = string
  default = "g5.xlarge"
}

variable "subnet_id" {
  type    = string
  default = ""
}

variable "volume_size" {
  type    = number
  default = 120
}

variable "base_ami_name" {
  type        = string
  description = "Name filter of the base AMI (a deep-learning base AMI by default)."
  default     = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) *"
}

variable "base_ami_owner" {
  type    = string
  default = "amazon"
}

variable "ssh_username" {
  type    = string
  default = "ubuntu"
}

variable "wheelhouse" {
  type        = string
  description = "Directory of wheels: spotagent and its agent dependencies (make wheelhouse)."
  default     = "build/wheelhouse"
}

variable "local_host" {
  type    = string
  default = "127.0.0.1"
}

variable "local_port" {
  type    = number
  default = 2222
}

variable "local_user" {
  type    = string
  default = "root"
}

variable "local_key_file" {
  type    = string
  default = "build/packer-ssh/id_ed25519"
}

locals {
  ami_name = "spotagent-${formatdate("YYYYMMDD-hhmmss", timestamp())}"
}

source "amazon-ebs" "spotagent" {
  region        = var.region
  instance_type = var.instance_type
  subnet_id     = var.subnet_id
  ami_name      = local.ami_name
  ssh_username  = var.ssh_username

  source_ami_filter {
    filters = {
      name                = var.base_ami_name
      root-device-type    = "ebs"
      virtualization-type = "hvm"
    }
    owners      = [var.base_ami_owner]
    most_recent = true
  }

  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = var.volume_size
    volume_type           = "gp3"
    iops                  = 3000
    throughput            = 250
    delete_on_termination = true
  }

  tags = {
    Name                = local.ami_name
    "spotagent:version" = "0.1.0"
  }
}

# The same provisioning, run over SSH against a local machine (CI: a booted systemd-nspawn
# container), so the provisioning scripts are exercised without AWS.
source "null" "local" {
  communicator         = "ssh"
  ssh_host             = var.local_host
  ssh_port             = var.local_port
  ssh_username         = var.local_user
  ssh_private_key_file = var.local_key_file
}

build {
  sources = ["source.amazon-ebs.spotagent", "source.null.local"]

  provisioner "shell" {
    inline = ["mkdir -p /tmp/spotagent-install/wheelhouse"]
  }

  provisioner "file" {
    source      = "${var.wheelhouse}/"
    destination = "/tmp/spotagent-install/wheelhouse"
  }

  provisioner "file" {
    sources     = ["systemd/spotagent.service", "packer/files/config.toml", "agent/iam/instance-policy.json"]
    destination = "/tmp/spotagent-install/"
  }

  # As root: through sudo for the AMI's login user (ubuntu), directly when Packer already logs
  # in as root (the null source in CI; a minimal image has no sudo).
  provisioner "shell" {
    execute_command = "chmod +x {{ .Path }}; if [ \"$(id -u)\" = 0 ]; then {{ .Vars }} {{ .Path }}; else sudo -E sh -c '{{ .Vars }} {{ .Path }}'; fi"
    scripts         = ["packer/scripts/install.sh"]
  }
}
