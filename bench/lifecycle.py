"""Lifecycle benchmark: the demo's figures over several notice cycles on one pool volume.

    .venv/bin/python bench/lifecycle.py [--cycles 3] [--root torch|busybox] [--steps 20]

As `spotagent demo`, with real `spotagent run` processes against the emulators, loop devices,
real mounts and a real chroot (the cached Debian + torch image, or with `--root busybox` the
tests' busybox root and shell trainer for a fast run). Instance 1 claims the volume and trains;
a spot notice makes it commit and release; instance 2 claims the volume, resumes, trains
`--steps` more steps and gets its notice; ... ; after `--cycles` notices the last instance is
drained with `spotagent drain`. Per notice cycle it measures

- notice detected -> checkpoint committed, against 1.15 x (checkpoint bytes / fsynced write
  bandwidth of the disk, measured in the same cycle beside the volume images) + 1 s;
- checkpoint committed -> volume available (attach/detach delays off), against 5 s;
- the agent's own time from exec to trainer exec, without the claim and device waits, against
  2 s (next to a bare `python -c pass` start measured in the same run, for the noise);
- steps lost at the handover to the next instance, against 0;
- the agent's CPU (% of one core) and RSS over a 10 s window of training, against 0.5 % / 60 MB;

and prints each cycle, then median and max with their ratio to the target. Exit status 1 when
a target is missed (by the max), 2 when the run itself failed.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from spotagent import log as splog
from spotagent.demo import (
    AGENT_OWN_TARGET_S,
    COMMIT_FACTOR,
    COMMIT_SLACK_S,
    CPU_TARGET_PCT,
    RELEASE_TARGET_S,
    RSS_TARGET_MB,
    Cycle,
    Scenario,
    Workload,
    fsync_write_bandwidth,
    install_stop_handler,
    torch_workload,
)
from spotagent.errors import SpotagentError

REPO = Path(__file__).resolve().parent.parent


def busybox_workload() -> Workload:
    """The tests' busybox root and protocol-speaking shell trainer (tests/agent_world.py)."""
    sys.path.insert(0, str(REPO / "tests"))
    import agent_world  # type: ignore[import-not-found]

    def image(workdir: Path) -> Path:
        path: Path = agent_world.busybox_image(workdir / "busybox")
        return path

    return Workload("busybox", image, dict(agent_world.TRAINER_SETTINGS))


def python_start_s(repeats: int = 5) -> float:
    """Median wall time of `python -c pass` (this interpreter): the machine's noise floor."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(cycles: int, steps: int, workload: Workload, workdir: Path) -> int:
    s = Scenario(workdir, workload, say=print)
    results: list[Cycle] = []
    targets: list[float] = []
    bandwidths: list[float] = []
    lost: list[int] = []
    drained: Cycle | None = None
    try:
        install_stop_handler()
        s.start()
        run_ = s.boot("1")
        boot = s.wait_training(run_)
        until = steps
        for i in range(1, cycles + 1):
            cyc = s.train_then_notice(run_, until_step=until, boot=boot)
            bw = fsync_write_bandwidth(s.world.plane.image_dir, cyc.checkpoint_bytes)
            results.append(cyc)
            bandwidths.append(bw)
            targets.append(COMMIT_FACTOR * cyc.checkpoint_bytes / bw + COMMIT_SLACK_S)
            nxt = s.boot(str(i + 1))
            boot = s.wait_training(nxt, past=cyc.committed_step)
            lost.append(s.resumed(cyc, nxt))
            run_ = nxt
            until = cyc.committed_step + steps
        drained = s.drain(run_, boot)
    except SpotagentError as exc:
        print(f"bench FAILED: {exc}")
        return 2
    finally:
        problems = s.close()
        for p in problems:
            print(f"left behind: {p}")
    if problems:
        return 2
    return report(results, targets, bandwidths, lost, drained)


def report(results: Sequence[Cycle], targets: Sequence[float], bandwidths: Sequence[float],
           lost: Sequence[int], drained: Cycle | None) -> int:
    base = python_start_s()
    print()
    print(f"{'cycle':>5} {'ckpt MB':>8} {'disk MB/s':>9} {'notice->commit':>15} {'target':>7} "
          f"{'commit->avail':>14} {'own boot':>9} {'claim':>6} {'lost':>5} {'cpu %':>6} "
          f"{'rss MB':>7} {'busy':>5}")
    for c, t, bw, n in zip(results, targets, bandwidths, lost, strict=True):
        print(f"{c.label:>5} {c.checkpoint_bytes / 1e6:8.1f} {bw / 1e6:9.0f} "
              f"{c.notice_to_commit:14.3f}s {t:6.3f}s {c.commit_to_available:13.3f}s "
              f"{c.boot.own:8.3f}s {c.boot.claim:5.2f}s {n:5d} {c.cpu_pct:6.2f} {c.rss_mb:7.1f} "
              f"{c.busy_after_unmount:4.1f}s")
    if drained is not None:
        print(f"{drained.label:>5} (drained) {'':>48} {drained.commit_to_available:13.3f}s "
              f"{drained.boot.own:8.3f}s {drained.boot.claim:5.2f}s {'':>19} "
              f"{drained.busy_after_unmount:4.1f}s")
    print(f"python -c pass on this machine now: {base:.3f} s (noise floor of the boot figure)")
    print("busy = seconds the unmounted device stayed busy because another mount namespace on "
          "this machine held a copy of the mount (part of commit -> available)")
    print()
    everyone = [*results, *([drained] if drained else [])]
    rows: list[tuple[str, list[float], float, str, Callable[[float, float], bool]]] = [
        ("notice -> commit / its target", [c.notice_to_commit / t
                                           for c, t in zip(results, targets, strict=True)],
         1.0, "ratio", lambda v, t: v <= t),
        ("commit -> available", [c.commit_to_available for c in everyone], RELEASE_TARGET_S,
         "s", lambda v, t: v <= t),
        ("agent's own boot time", [c.boot.own for c in everyone], AGENT_OWN_TARGET_S, "s",
         lambda v, t: v <= t),
        ("steps lost per notice", [float(n) for n in lost], 0.0, "steps", lambda v, t: v <= t),
        ("agent CPU while training", [c.cpu_pct for c in results], CPU_TARGET_PCT,
         "% core", lambda v, t: v < t),
        ("agent RSS while training", [c.rss_mb for c in results], RSS_TARGET_MB, "MB",
         lambda v, t: v < t),
    ]
    print(f"{'figure':<30} {'median':>9} {'max':>9} {'target':>9}  {'max/target':>10}")
    missed = 0
    for name, values, target, unit, ok in rows:
        vals = [v for v in values if not math.isnan(v)]
        if not vals:
            continue
        med, mx = statistics.median(vals), max(vals)
        ratio = "-" if target == 0 else f"{mx / target:.2f}"
        good = ok(mx, target)
        missed += not good
        print(f"{name:<30} {med:9.3f} {mx:9.3f} {target:9.3f}  {ratio:>10}  {unit:<6} "
              f"{'PASS' if good else 'FAIL'}")
    return 1 if missed else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=3, help="spot notices (default 3)")
    p.add_argument("--root", choices=("torch", "busybox"), default="torch",
                   help="volume content: the cached Debian + torch image (default) or the "
                   "tests' busybox root with a shell trainer (fast)")
    p.add_argument("--steps", type=int, default=20,
                   help="steps each instance trains before its notice (default 20)")
    p.add_argument("--cache", type=Path, default=None, help="image cache directory")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    if args.cycles < 1:
        p.error("--cycles must be at least 1")
    if os.geteuid() != 0:
        print("bench/lifecycle.py needs root (loop devices, mounts, chroot)")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="spotagent-bench-"))
    with open(workdir / "bench.log", "a", encoding="utf-8") as logf:
        splog.configure(json=True, stream=logf)
        workload = (busybox_workload() if args.root == "busybox"
                    else torch_workload(args.cache))
        print(f"bench/lifecycle.py: {args.cycles} notice cycles, {args.root} root, "
              f"workdir {workdir}")
        code = run(args.cycles, args.steps, workload, workdir)
    if args.keep or code == 2:
        print(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
