# Modern Packer (>= 1.10) keeps the Amazon builder in a plugin and needs this block; Debian 12's
# Packer 1.6.6 rejects it, so it lives in its own file. With modern Packer:
#   packer init packer/ && packer build -only=amazon-ebs.spotagent packer/
packer {
  required_plugins {
    amazon = {
      version = ">= 1.3.0"
      source  = "github.com/hashicorp/amazon"
    }
  }
}
