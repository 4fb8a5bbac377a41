"""`spotagent testbed up`: the emulated AWS world in the foreground, for manual use."""

from __future__ import annotations

import argparse
import signal
import tempfile
import threading
from pathlib import Path
from types import FrameType


def cmd_testbed_up(args: argparse.Namespace) -> int:
    from spotagent.testbed.rootfs import build_busybox_root
    from spotagent.testbed.world import FAKE_CREDENTIALS, World, make_fs_image

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spotagent-testbed-"))
    zones: list[str] = args.az or [f"{args.region}a"]
    stop = threading.Event()

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with World(workdir, region=args.region, attach_delay=args.attach_delay,
               detach_delay=args.detach_delay) as world:
        snapshot = None
        if args.volumes:
            if args.image == "busybox":
                root = build_busybox_root(workdir / "busybox-root")
                snapshot = world.make_snapshot(make_fs_image(workdir / "busybox.img", root,
                                                             size_mib=64))
            elif args.image != "empty":
                snapshot = world.make_snapshot(Path(args.image))
            vols = world.make_pool_volumes(args.pool, args.volumes, snapshot_id=snapshot)
        else:
            vols = []
        print("spotagent testbed is up (Ctrl-C stops it and cleans up)")
        print(f"  EC2 endpoint   {world.ec2.endpoint_url}   (region {args.region})")
        print(f"  IMDS           {world.imds.url}/<instance-id>   control: "
              f"{world.imds.url}/_control/<instance-id>/spot-action")
        print("  credentials    " + " ".join(f"{k}={v}" for k, v in FAKE_CREDENTIALS.items()))
        print(f"  workdir        {workdir}")
        if vols:
            print(f"  pool {args.pool!r}: " + ", ".join(vols))
        for i in range(args.instances):
            az = zones[i % len(zones)]
            inst = world.launch(az, pool=args.pool)
            print(f"  instance {inst.instance_id} in {az}")
            print(f"      IMDS       {inst.imds_url}")
            print(f"      by-id dir  {inst.by_id_dir}")
            print(f"      run agent  {' '.join(inst.agent_argv('run'))}")
        print("  fire a notice  curl -X POST "
              f"{world.imds.url}/_control/<instance-id>/spot-action "
              "-d '{\"action\": \"terminate\"}'", flush=True)
        stop.wait()
        print("stopping testbed", flush=True)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tb = sub.add_parser("testbed", help="emulated AWS for tests, demos and manual runs")
    tb_sub = tb.add_subparsers(dest="testbed_command", required=True, metavar="SUBCOMMAND")
    up = tb_sub.add_parser("up", help="start IMDS + strict EC2 + device plane in the foreground")
    up.add_argument("--workdir", default=None, help="where images and instance dirs live")
    up.add_argument("--region", default="us-east-1")
    up.add_argument("--az", action="append", default=None,
                    help="AZ of the instances (repeatable; default <region>a)")
    up.add_argument("--instances", type=int, default=1, help="emulated instances to launch")
    up.add_argument("--pool", default="dl", help="pool name")
    up.add_argument("--volumes", type=int, default=1, help="pool volumes to create")
    up.add_argument("--image", default="busybox",
                    help="volume content: busybox (a tiny root), empty, or an image file path")
    up.add_argument("--attach-delay", type=float, default=0.0)
    up.add_argument("--detach-delay", type=float, default=0.0)
    up.set_defaults(handler=cmd_testbed_up)
