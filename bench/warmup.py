"""Warm-up benchmark: achieved rate against the cap, and against raw dd on the same device.

    sudo .venv/bin/python bench/warmup.py [--size-mib 1024] [--caps 0.02,0.05,0.1,0.25]

Sets up a loop device over a temporary image filled with non-zero data, then in one run:

1. baseline: `dd if=<dev> of=/dev/null bs=1M iflag=direct` (the device's raw sequential rate
   here, through the same O_DIRECT path the warm-up uses);
2. `Warmup` uncapped (`max_bytes_per_s=inf`), median of three runs: its overhead against dd
   (ratio near 1.0 wanted);
3. `Warmup` capped at each fraction of the baseline in `--caps`: achieved rate / cap (≤ 1.0,
   and near it, wanted).

Figures are printed as ratios against the baseline measured in the same run: a loop device
over the page cache is far faster than an EBS volume, so only the ratios carry over.
Exit status 1 when a capped run exceeds its cap by more than 10 %.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spotagent import log as splog
from spotagent.warmup import Warmup

MIB = 1 << 20


def sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, timeout=600)


def dd_rate(device: str) -> float:
    """Bytes/s of one O_DIRECT sequential read of the whole device with dd."""
    start = time.monotonic()
    res = sh("dd", f"if={device}", "of=/dev/null", "bs=1M", "iflag=direct")
    elapsed = time.monotonic() - start
    m = re.search(r"^(\d+) bytes", res.stderr, re.M)
    size = int(m.group(1)) if m else 0
    return size / elapsed


def warmup_rate(device: str, cap: float) -> tuple[float, float]:
    """(bytes/s over the whole run, seconds) of one Warmup run."""
    w = Warmup(Path(device), max_bytes_per_s=cap)
    start = time.monotonic()
    w.start()
    if not w.join(timeout=600):
        w.stop()
        raise SystemExit("warm-up did not finish within 600 s")
    elapsed = time.monotonic() - start
    p = w.progress
    if not p.done:
        raise SystemExit(f"warm-up failed: {p.error}")
    return p.total_bytes / elapsed, elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--caps", default="0.02,0.05,0.1,0.25",
                    help="caps as fractions of the dd baseline, comma separated")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/warmup.py needs root (loop devices)", file=sys.stderr)
        return 2
    splog.configure(json=True, level="warning", stream=sys.stderr)
    fractions = [float(x) for x in args.caps.split(",") if x.strip()]

    with tempfile.TemporaryDirectory(prefix="spotagent-bench-warmup-") as tmp:
        image = Path(tmp) / "disk.img"
        block = os.urandom(MIB)
        with open(image, "wb") as f:
            for _ in range(args.size_mib):
                f.write(block)
        device = sh("losetup", "--find", "--show", str(image)).stdout.strip()
        try:
            dd_rate(device)  # one pass to settle caches on both sides
            base = statistics.median(dd_rate(device) for _ in range(3))
            print(f"device: {device}, {args.size_mib} MiB loop device over a file")
            print(f"baseline dd iflag=direct bs=1M: {base / MIB:8.1f} MiB/s = 1.00 (median of 3)")
            runs = sorted(warmup_rate(device, math.inf) for _ in range(3))
            rate, secs = runs[1]
            print(f"warm-up uncapped:              {rate / MIB:8.1f} MiB/s = {rate / base:.2f} "
                  f"of dd ({secs:.2f} s)")
            worst = 0.0
            print(f"{'cap/dd':>8} {'cap MiB/s':>10} {'got MiB/s':>10} {'got/cap':>8} {'secs':>6}")
            for frac in fractions:
                cap = base * frac
                rate, secs = warmup_rate(device, cap)
                ratio = rate / cap
                worst = max(worst, ratio)
                print(f"{frac:8.2f} {cap / MIB:10.1f} {rate / MIB:10.1f} {ratio:8.2f} {secs:6.2f}")
        finally:
            sh("losetup", "-d", device)
    if worst > 1.10:
        print(f"FAIL: a capped warm-up ran at {worst:.2f} x its cap", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
