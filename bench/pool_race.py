"""How long a pool takes to settle when many fresh instances race for few warm volumes.

N agents (threads, each with its own boto3 client and its own emulated instance) claim at once
from a pool of M volumes on the strict EC2 emulator (real HTTP, AWS's attach rules). The pool
has settled when every agent holds a volume or has been told the pool is empty. Baseline, in the
same run: one uncontended claim on the same emulator with the same attach delay. Printed: median
and max settle time over the repeats, the baseline median, and their ratio; also the EC2 calls
and the failed attaches per agent (what contention costs in API calls, which AWS throttles);
every round checks that no volume was attached twice.

    .venv/bin/python bench/pool_race.py [--agents 32] [--volumes 8] [--delays 0,1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

from structlog.testing import capture_logs

from spotagent import ec2, volumes
from spotagent.testbed.ec2 import StrictEc2Server

REGION = "us-east-1"
AZ = "us-east-1a"
AMI = "ami-12c6146b"
POOL = "bench"


def setup(server: StrictEc2Server, n_volumes: int, n_instances: int) -> list[str]:
    server.reset()
    c = server.client()
    for _ in range(n_volumes):
        c.create_volume(AvailabilityZone=AZ, Size=1, VolumeType="gp3", TagSpecifications=[
            {"ResourceType": "volume", "Tags": [{"Key": volumes.POOL_TAG, "Value": POOL}]}])
    r = c.run_instances(ImageId=AMI, MinCount=n_instances, MaxCount=n_instances,
                        Placement={"AvailabilityZone": AZ})
    return [i["InstanceId"] for i in r["Instances"]]


def race(agents: list[volumes.Pool], iids: list[str]) -> tuple[float, list[object], int]:
    """(seconds from the start signal until the last agent is done, results, failed attaches)"""
    start = threading.Barrier(len(agents) + 1)
    results: list[object] = [None] * len(agents)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = agents[i].claim(iids[i], AZ)
        except volumes.PoolEmptyError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(agents))]
    with capture_logs() as logs:
        for t in threads:
            t.start()
        start.wait()
        t0 = time.monotonic()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
    conflicts = sum(1 for e in logs if e["event"] == "claim_conflict")
    return elapsed, results, conflicts


def check(server: StrictEc2Server, results: list[object], n_volumes: int) -> None:
    claims = [r for r in results if isinstance(r, volumes.Claim)]
    listing = volumes.Pool(server.client(), POOL).volumes()
    holders = {v.attached_to for v in listing if v.attached_to}
    if not (len(claims) == n_volumes == len(holders) == len({c.volume_id for c in claims})
            and all(isinstance(r, volumes.Claim | volumes.PoolEmptyError) for r in results)):
        raise SystemExit(f"pool_race: WRONG RESULT: {len(claims)} claims, {len(holders)} "
                         f"holders for {n_volumes} volumes: {results}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--volumes", type=int, default=8)
    ap.add_argument("--delays", default="0,1", help="emulated attach delays, seconds")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--poll", type=float, default=1.0,
                    help="the agent's poll interval while an attach completes (default: the "
                    "agent's own, 1 s)")
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    delays = [float(d) for d in args.delays.split(",")]

    with StrictEc2Server(region=REGION) as server:
        calls = [0]
        lock = threading.Lock()

        def count(**_kwargs: object) -> None:
            with lock:
                calls[0] += 1

        def pool(seed: int) -> volumes.Pool:
            client = ec2.client(region=REGION, endpoint_url=server.endpoint_url)
            client.meta.events.register("before-call.ec2", count)  # one per API call
            return volumes.Pool(client, POOL, rng=random.Random(seed),
                                poll_interval=args.poll)

        agents = [pool(i) for i in range(args.agents)]  # clients made once, outside the clock
        print(f"pool_race: {args.agents} agents vs {args.volumes} volumes, poll "
              f"{args.poll:g} s, {args.repeats} repeats, {os.cpu_count()} CPUs")
        print(f"{'attach delay':>12} {'baseline':>9} {'settle med':>10} {'settle max':>10} "
              f"{'ratio':>6} {'EC2 calls/agent':>16} {'failed attaches/agent':>22}")
        for delay in delays:
            server.set_delays(delay, 0.0)
            base: list[float] = []
            for _ in range(args.repeats):
                iids = setup(server, 1, 1)
                elapsed, results, _ = race(agents[:1], iids)
                check(server, results, 1)
                base.append(elapsed)
            settle: list[float] = []
            failed: list[int] = []
            made: list[int] = []
            for _ in range(args.repeats):
                iids = setup(server, args.volumes, args.agents)
                calls[0] = 0
                elapsed, results, conflicts = race(agents, iids)
                made.append(calls[0])
                check(server, results, args.volumes)
                settle.append(elapsed)
                failed.append(conflicts)
            b = statistics.median(base)
            s = statistics.median(settle)
            print(f"{delay:>11g}s {b:>8.3f}s {s:>9.3f}s {max(settle):>9.3f}s {s / b:>5.1f}x "
                  f"{statistics.median(made) / args.agents:>16.2f} "
                  f"{statistics.median(failed) / args.agents:>22.2f}")
        if server.errors:
            raise SystemExit(f"pool_race: emulator errors: {server.errors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
