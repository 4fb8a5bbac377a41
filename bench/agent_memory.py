"""Agent memory: what the trimmed EC2 model saves, in a bare client and in a training agent.

    .venv/bin/python bench/agent_memory.py [--repeats 5] [--window 10] [--rounds 1]
                                           [--no-agent] [--baseline-tree DIR]

1. A fresh process per measurement (`--repeats` each, interleaved, median): the agent's EC2 side
   imported without a client (the baseline), then + one EC2 client on botocore's full model,
   + one on the trimmed model (`spotagent.ec2model`), and `import boto3` + `boto3.client("ec2")`
   for reference. RSS and high-water mark (VmHWM) after the client is made, the client's cost
   over the baseline, and the trimmed/full ratios.
2. Real `spotagent run` processes of emulated instances (needs root: loop devices, mounts,
   chroot; the tests' busybox root and shell trainer, the product's 0.5 s IMDS poll), one after
   the other on the same pool volume, `--rounds` times in alternating order: with
   `SPOTAGENT_EC2_MODEL=full` (the baseline) and with the trimmed model (built once
   beforehand, as an image build does). Peak RSS and CPU over `--window` seconds of training
   (as `spotagent demo` measures them), the process's VmHWM, and the trimmed/full ratio,
   against the issue's 60 MB target.
   `--baseline-tree DIR` adds agents run from another source tree (`DIR/spotagent/...`), e.g.
   the code before this change:
       mkdir -p /tmp/before/spotagent
       git archive <commit> agent | tar -x -C /tmp/before/spotagent --strip-components=1

MB are 10^6 bytes, as in `spotagent demo`. Exit status 1 when the trimmed agent misses the RSS
target, 2 when the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import botocore

from spotagent import ec2model
from spotagent import log as splog
from spotagent.demo import AGENT_SETTINGS, RSS_TARGET_MB, sample_usage
from spotagent.errors import SpotagentError

REPO = Path(__file__).resolve().parent.parent

# Runs in a fresh interpreter: import the agent's EC2 side, maybe make one client, report.
_PROBE = r"""
import gc, json, sys
variant = sys.argv[1]
from spotagent import log
log.configure(json=True)  # events to stderr, stdout is ours
from spotagent import ec2, volumes  # the agent's EC2 side
client = None
if variant == "full":
    client = ec2.client(region="us-east-1", model="full")
elif variant == "trimmed":
    client = ec2.client(region="us-east-1")
elif variant == "boto3":
    import boto3
    client = boto3.client("ec2", region_name="us-east-1")
gc.collect()
status = dict(l.split(":", 1) for l in open("/proc/self/status"))
ops = len(client.meta.service_model.operation_names) if client else 0
print(json.dumps({"rss": int(status["VmRSS"].split()[0]) * 1024,
                  "hwm": int(status["VmHWM"].split()[0]) * 1024, "operations": ops}))
"""

CLIENT_VARIANTS = (
    ("bare", "agent's EC2 side imported, no client"),
    ("full", "+ EC2 client, full model"),
    ("trimmed", "+ EC2 client, trimmed model"),
    ("boto3", "+ import boto3, boto3.client('ec2')"),
)


def base_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SPOTAGENT_"))}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE="/nonexistent",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent", SPOTAGENT_CACHE=str(cache))
    return env


def build_model(cache: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "spotagent.ec2model", "build", "--base",
                           str(cache)], env=base_env(cache), capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise SpotagentError("building the trimmed model failed", stderr=proc.stderr[-300:])
    return time.perf_counter() - t0


def probe(variant: str, cache: Path) -> dict[str, int]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, variant], env=base_env(cache),
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise SpotagentError("probe failed", variant=variant, stderr=proc.stderr[-300:])
    out: dict[str, int] = json.loads(proc.stdout)
    return out


def client_figures(cache: Path, repeats: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, int]]] = {v: [] for v, _ in CLIENT_VARIANTS}
    for _ in range(repeats):
        for variant, _label in CLIENT_VARIANTS:  # interleaved: drift hits all alike
            samples[variant].append(probe(variant, cache))
    return {v: {k: statistics.median(s[k] for s in runs) for k in ("rss", "hwm", "operations")}
            for v, runs in samples.items()}


def report_clients(fig: dict[str, dict[str, float]], repeats: int) -> None:
    bare = fig["bare"]["rss"]
    print(f"\nEC2 client in a fresh process (median of {repeats}; MB = 10^6 bytes)")
    print(f"{'':<40} {'ops':>4} {'RSS MB':>7} {'HWM MB':>7} {'client MB':>9}")
    for variant, label in CLIENT_VARIANTS:
        f = fig[variant]
        cost = "" if variant == "bare" else f"{(f['rss'] - bare) / 1e6:+9.1f}"
        print(f"{label:<40} {int(f['operations']):>4} {f['rss'] / 1e6:7.1f} "
              f"{f['hwm'] / 1e6:7.1f} {cost:>9}")
    full, trimmed = fig["full"], fig["trimmed"]
    print(f"trimmed / full: client cost {(trimmed['rss'] - bare) / (full['rss'] - bare):.2f}, "
          f"process RSS {trimmed['rss'] / full['rss']:.2f}, "
          f"high-water mark {trimmed['hwm'] / full['hwm']:.2f}")


# --- real agents ------------------------------------------------------------------------------


@dataclass
class AgentRun:
    variant: str
    model: str       # what the agent logged (ec2_model_selected), "-" for code that does not
    rss_mb: float    # peak over the window
    hwm_mb: float    # the process's high-water mark at the end of the window
    cpu_pct: float


def _hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def agent_runs(workdir: Path, cache: Path, window: float, rounds: int,
               baseline_tree: Path | None) -> list[AgentRun]:
    sys.path.insert(0, str(REPO / "tests"))
    import agent_world  # type: ignore[import-not-found]

    variants: list[tuple[str, dict[str, str]]] = [
        ("full model", {"SPOTAGENT_CACHE": str(cache), "SPOTAGENT_EC2_MODEL": "full"}),
        ("trimmed model", {"SPOTAGENT_CACHE": str(cache)}),
    ]
    if baseline_tree is not None:
        variants.insert(0, (f"tree {baseline_tree}", {"PYTHONPATH": str(baseline_tree)}))
    runs: list[AgentRun] = []
    with agent_world.emulated_world(workdir) as world:
        image = agent_world.busybox_image(workdir / "busybox")
        agent_world.pool_volumes(world, image)
        for i in range(rounds):
            # every other round in reverse: no variant always runs first or last
            for name, env in (variants if i % 2 == 0 else variants[::-1]):
                inst = world.launch(pool="dl", settings=agent_world.settings(**AGENT_SETTINGS))
                agent = agent_world.Agent(inst, env).start()
                try:
                    agent.training_past(3, timeout=120)
                    cpu, rss = sample_usage(agent.pid, window)
                    hwm = _hwm_mb(agent.pid)
                    sel = agent.events("ec2_model_selected")
                    world.imds.fire_spot_action(inst.instance_id, "terminate")
                    code = agent.wait_exit(120)
                except AssertionError as exc:  # agent_world's waits
                    raise SpotagentError("agent run failed", variant=name,
                                         error=str(exc).splitlines()[0]) from exc
                if code != 0:
                    raise SpotagentError("agent did not release cleanly", variant=name,
                                         code=code, log=agent.output()[-300:])
                runs.append(AgentRun(name, str(sel[0]["model"]) if sel else "-", rss, hwm,
                                     cpu))
                print(f"  {name:<28} logged model {runs[-1].model:<8} RSS {rss:6.1f} MB  "
                      f"HWM {hwm:6.1f} MB  CPU {cpu:5.2f} %", flush=True)
    return runs


def report_agents(runs: Sequence[AgentRun], window: float) -> int:
    print(f"\nspotagent run while training (busybox root; peak RSS and CPU over {window:g} s; "
          f"median over rounds; MB = 10^6 bytes)")
    print(f"{'':<30} {'RSS MB':>7} {'HWM MB':>7} {'CPU %':>6} {'RSS / target':>12}")
    by: dict[str, list[AgentRun]] = {}
    for r in runs:
        by.setdefault(r.variant, []).append(r)
    med: dict[str, float] = {}
    for name, rs in by.items():
        med[name] = statistics.median(r.rss_mb for r in rs)
        print(f"{name:<30} {med[name]:7.1f} {statistics.median(r.hwm_mb for r in rs):7.1f} "
              f"{statistics.median(r.cpu_pct for r in rs):6.2f} "
              f"{med[name] / RSS_TARGET_MB:12.2f}")
    worst = max(r.rss_mb for r in by["trimmed model"])
    print(f"trimmed / full RSS: {med['trimmed model'] / med['full model']:.2f} "
          f"({med['full model'] - med['trimmed model']:.1f} MB less)")
    for name in by:
        if name.startswith("tree "):
            print(f"trimmed / {name} RSS: {med['trimmed model'] / med[name]:.2f}")
    good = worst < RSS_TARGET_MB
    print(f"trimmed agent RSS (max) {worst:.1f} MB vs target < {RSS_TARGET_MB:g} MB: "
          f"{'PASS' if good else 'FAIL'}")
    return 0 if good else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per client variant")
    p.add_argument("--window", type=float, default=10.0, help="seconds of training sampled")
    p.add_argument("--rounds", type=int, default=1, help="agent runs per variant")
    p.add_argument("--no-agent", action="store_true", help="only the client figures")
    p.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                   help="also run agents from this source tree (DIR/spotagent)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    if args.baseline_tree is not None and not (args.baseline_tree / "spotagent").is_dir():
        p.error(f"{args.baseline_tree}/spotagent is not a directory")
    workdir = Path(tempfile.mkdtemp(prefix="spotagent-bench-memory-"))
    cache = workdir / "cache"
    code = 0
    try:
        with open(workdir / "bench.log", "a", encoding="utf-8") as logf:
            splog.configure(json=True, stream=logf)
            built = build_model(cache)
            stamp = json.loads((ec2model.data_root(cache) / "ec2"
                                / ec2model.latest_api_version() / ec2model.STAMP).read_text())
            size = (ec2model.data_root(cache) / "ec2" / stamp["api_version"]
                    / ec2model.MODEL).stat().st_size
            print(f"bench/agent_memory.py: botocore {botocore.__version__}, EC2 API "
                  f"{stamp['api_version']}; trimmed model {len(stamp['operations'])} operations,"
                  f" {stamp['shapes']} of {stamp['source_shapes']} shapes, {size / 1e3:.0f} kB "
                  f"(built in {built:.2f} s by a child process); workdir {workdir}")
            report_clients(client_figures(cache, args.repeats), args.repeats)
            if args.no_agent:
                pass
            elif os.geteuid() != 0:
                print("\nspotagent run figures skipped: they need root (loop devices, mounts, "
                      "chroot)")
            else:
                print(f"\nspotagent run processes ({args.rounds} round(s)):", flush=True)
                runs = agent_runs(workdir / "world", cache, args.window, args.rounds,
                                  args.baseline_tree)
                code = report_agents(runs, args.window)
    except SpotagentError as exc:
        print(f"bench FAILED: {exc}")
        code = 2
    if args.keep or code == 2:
        print(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

