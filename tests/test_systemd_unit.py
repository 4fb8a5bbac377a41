"""systemd/spotagent.service passes `systemd-analyze verify` with no output at all.

systemd only warns (exit 0) about unknown keys, so any output fails. The unit is verified in a
scratch root holding the system's units and an executable at ExecStart, as on the AMI.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "spotagent.service"

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                reason="systemd-analyze not installed (make setup installs it)")


def verify(tmp_path: Path, unit_text: str) -> str:
    root = tmp_path / "root"
    exe = root / "opt/spotagent/venv/bin/spotagent"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/spotagent.service").write_text(unit_text)
    proc = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "spotagent.service"],
                          capture_output=True, text=True, timeout=60)
    return (proc.stdout + proc.stderr).strip() + ("" if proc.returncode == 0 else
                                                  f"\nexit {proc.returncode}")


def test_unit_verifies_without_any_output(tmp_path: Path) -> None:
    assert verify(tmp_path, UNIT.read_text()) == ""


def test_a_misspelt_key_is_caught(tmp_path: Path) -> None:
    bad = UNIT.read_text().replace("WatchdogSec=", "WatchdgSec=")
    assert "Unknown key 'WatchdgSec'" in verify(tmp_path, bad)


def test_unit_makes_the_promises_the_readme_documents() -> None:
    text = UNIT.read_text()
    for line in ("Type=notify", "KillMode=mixed", "Restart=on-failure", "WatchdogSec=",
                 "ConditionPathExists=!/etc/spotagent/disabled", "RestartPreventExitStatus=2",
                 "After=network-online.target"):
        assert line in text
    stop = int(text.split("TimeoutStopSec=")[1].split()[0])
    assert stop > 90 + 30, "stop timeout must exceed the default drain budget"
