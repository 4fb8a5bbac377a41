"""`packer build -only=null.local` provisions a booted container as it would an AMI.

The image comes from the session fixture (image.py): a cache hit is the result of this very
build for identical inputs (wheel contents, template, install.sh, unit, config, policy).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Generous bounds to catch hangs: a cold first test also debootstraps and runs packer build.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


def test_packer_build_finished_and_ran_the_install_script(spotagent_image) -> None:
    log = spotagent_image.packer_log.read_text()
    assert "Build 'null.local' finished" in log, log
    assert "spotagent-install: done: 0.1.0" in log, log
    assert "Created symlink /etc/systemd/system/multi-user.target.wants/spotagent.service" in log


def test_the_image_has_the_agent_the_enabled_unit_and_the_default_config(
        spotagent_image) -> None:
    layer = spotagent_image.layer
    venv = layer / "opt/spotagent/venv"
    assert os.access(venv / "bin/spotagent", os.X_OK)
    # The image's own Python, not the build machine's.
    assert "home = /usr/bin" in (venv / "pyvenv.cfg").read_text()
    assert list((venv / "lib").glob("python3.*/site-packages/boto3"))
    assert not list((venv / "lib").glob("python3.*/site-packages/torch"))
    unit = layer / "etc/systemd/system/spotagent.service"
    assert unit.read_text() == (REPO / "systemd/spotagent.service").read_text()
    wants = layer / "etc/systemd/system/multi-user.target.wants/spotagent.service"
    assert os.readlink(wants) == "/etc/systemd/system/spotagent.service"
    config = layer / "etc/spotagent/config.toml"
    assert config.read_text() == (REPO / "packer/files/config.toml").read_text()
    policy = layer / "opt/spotagent/share/iam/instance-policy.json"
    assert policy.read_text() == (REPO / "agent/iam/instance-policy.json").read_text()


def test_the_image_keeps_nothing_of_the_build(spotagent_image) -> None:
    layer = spotagent_image.layer
    assert not (layer / "tmp/spotagent-install").exists()
    assert not (layer / "root/.ssh/authorized_keys").exists()
    assert not (layer / "etc/ssh/sshd_config.d/spotagent-packer.conf").exists()
    assert not (layer / "etc/systemd/system/spotagent.service.d").exists()
