"""`spotagent demo` end to end, once: the cached Debian + torch image (built here on a cold
cache: debootstrap, torch wheels, mkfs; minutes), instance A trains in the chroot, a spot
notice, A commits and releases, B resumes at the next step, a drain ends B, nothing is left
mounted or attached."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.root]

if os.geteuid() != 0:
    pytest.skip("needs root (loop devices, mounts, chroot)", allow_module_level=True)


@pytest.mark.timeout(2400)
def test_demo_resumes_at_the_next_step_and_leaves_nothing_behind(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "spotagent", "demo", "--workdir", str(work)],
                          capture_output=True, text=True, timeout=2300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert re.search(r"^steps lost: 0 ", out, re.M), out
    assert "cleanup: nothing mounted, no loop device left" in out, out
    m = re.search(r"A's last step (\d+), committed (\d+); B restored (\d+) and went on at "
                  r"step (\d+)", out)
    assert m, out
    last, committed, restored, first = map(int, m.groups())
    assert last == committed == restored and first == committed + 1
    for row in ("notice detected -> checkpoint committed", "checkpoint committed -> volume "
                "available", "agent's own time, start -> trainer exec", "agent CPU while "
                "training", "agent RSS while training"):
        assert row in out, row
    real = os.path.realpath(work)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert not any(line.split()[4].startswith(real) for line in mounts.splitlines())
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert real not in loops
