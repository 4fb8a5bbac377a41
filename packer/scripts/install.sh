#!/bin/sh
# Provision spotagent onto an image: its own virtualenv from the wheelhouse (no network
# needed), the systemd unit (enabled), a default config and the IAM policy document.
# Run as root by Packer (amazon-ebs on AWS, null over SSH in CI); idempotent.
set -eu
SRC=/tmp/spotagent-install
PREFIX=/opt/spotagent

log() { echo "spotagent-install: $*"; }

if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  log "installing python3-venv"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q && apt-get install -y -q python3 python3-venv
fi
for tool in mount umount blkid losetup; do
  command -v "$tool" >/dev/null 2>&1 || { log "missing $tool (util-linux)"; exit 1; }
done

log "virtualenv in $PREFIX/venv"
python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install --no-index --find-links "$SRC/wheelhouse" --quiet "spotagent[agent]"
"$PREFIX/venv/bin/spotagent" --help >/dev/null
# The agent's EC2 model trimmed to the calls it makes (8 MB instead of 24 MB of RSS), built now
# so the first boot does not spend its time on it.
"$PREFIX/venv/bin/python" -m spotagent.ec2model build

log "unit, config, IAM policy"
install -D -m 0644 "$SRC/spotagent.service" /etc/systemd/system/spotagent.service
install -d -m 0755 /etc/spotagent
if [ ! -e /etc/spotagent/config.toml ]; then
  install -m 0644 "$SRC/config.toml" /etc/spotagent/config.toml
fi
install -D -m 0644 "$SRC/instance-policy.json" "$PREFIX/share/iam/instance-policy.json"
systemctl daemon-reload || true
systemctl enable spotagent.service
# The staging directory would otherwise ship in the image (/tmp is a plain directory on AMIs).
rm -rf "$SRC"
log "done: $("$PREFIX/venv/bin/python" -c 'import spotagent; print(spotagent.__version__)')"
