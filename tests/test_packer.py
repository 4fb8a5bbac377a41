"""The Packer template validates with Debian's Packer 1.6.6 (make setup installs it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "packer/spotagent.pkr.hcl"


def packer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["packer", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def ssh_key(tmp_path: Path) -> Path:
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                   check=True, timeout=30)
    return key


def test_template_validates_with_its_provisioned_files(tmp_path: Path) -> None:
    (tmp_path / "spotagent-0.1.0-py3-none-any.whl").write_bytes(b"")
    ssh_key(tmp_path)
    proc = packer("validate", f"-var=wheelhouse={tmp_path}",
                  f"-var=local_key_file={tmp_path / 'id_ed25519'}", TEMPLATE)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_validation_notices_a_missing_provisioned_file(tmp_path: Path) -> None:
    ssh_key(tmp_path)
    proc = packer("validate", f"-var=wheelhouse={tmp_path / 'absent'}",
                  f"-var=local_key_file={tmp_path / 'id_ed25519'}", TEMPLATE)
    assert proc.returncode != 0
    assert "absent" in proc.stdout + proc.stderr


def test_gp3_declares_throughput_and_iops_and_plugins_live_apart() -> None:
    text = (REPO / TEMPLATE).read_text()
    assert 'volume_type           = "gp3"' in text
    assert "throughput" in text and "iops" in text
    assert "required_plugins" not in text
    assert "required_plugins" in (REPO / "packer/plugins.pkr.hcl").read_text()


def test_provisioning_script_is_valid_sh() -> None:
    proc = subprocess.run(["sh", "-n", str(REPO / "packer/scripts/install.sh")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the root branch needs root")
def test_the_install_script_runs_as_root_without_sudo(tmp_path: Path) -> None:
    """The shell provisioner's execute_command, as Packer renders it, when logged in as root
    (the null source in CI; minimal images have no sudo)."""
    text = (REPO / TEMPLATE).read_text()
    line = next(ln for ln in text.splitlines() if "execute_command" in ln)
    template = line.split("=", 1)[1].strip()[1:-1].replace('\\"', '"')
    script = tmp_path / "script.sh"
    out = tmp_path / "out"
    script.write_text(f'#!/bin/sh\necho "$(id -u) $PACKER_BUILD_NAME" > {out}\n')
    command = (template.replace("{{ .Path }}", str(script))
               .replace("{{ .Vars }}", "PACKER_BUILD_NAME='local'"))
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # no sudo needed on this path
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == "0 local\n"
