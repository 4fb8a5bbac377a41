"""`spotagent pool ...`: the operator's commands for the pool (run from a workstation).

Wiring only: arguments in, `spotagent.volumes` calls, one line per volume (or per AZ) out, JSON
lines with `--json`. EC2 failures surface as `Ec2Error` (one line naming the operation and the
AWS error code, exit 1) through `spotagent.cli.main`; bad arguments exit 2 (argparse).

These commands run on a workstation, briefly: their client uses botocore's full EC2 model
(`model="full"`; the trimmed model is the long-running agent's), so they write no cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import botocore.session

from spotagent import config as configmod
from spotagent import ec2, volumes
from spotagent.errors import SpotagentError

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client

_AWS_DEFAULTS = configmod.SCHEMA["aws"]
_POOL_DEFAULTS = configmod.SCHEMA["pool"]


class UsageError(SpotagentError):
    """A missing setting the command line must supply (exit 2, like argparse)."""

    exit_code = 2


def _checked(section: str, key: str, *, integer: bool = False) -> Callable[[str], Any]:
    """An argparse type that applies the config schema's converter (one rule, one message)."""
    conv = configmod.SCHEMA[section][key].conv

    def parse(text: str) -> Any:
        value: Any = text
        if integer:
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        try:
            return conv(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= n <= 100:
        raise argparse.ArgumentTypeError("must be between 1 and 100")
    return n


def _init_rate(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    lo, hi = volumes.INIT_RATE_RANGE
    if n != 0 and not lo <= n <= hi:
        raise argparse.ArgumentTypeError(f"must be 0 (EC2's default) or {lo}-{hi}")
    return n


def _volume_id(text: str) -> str:
    if not text.startswith("vol-") or not text[4:].isalnum():
        raise argparse.ArgumentTypeError(f"{text!r} is not a volume id (vol-...)")
    return text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `pool` command group to the `spotagent` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--region", default=None,
                        help="AWS region (default: AWS_REGION, AWS_DEFAULT_REGION, the profile's)")
    common.add_argument("--endpoint-url", default=None, metavar="URL",
                        help="EC2 endpoint (emulators, VPC endpoints)")
    common.add_argument("--max-attempts", type=_checked("aws", "max_attempts", integer=True),
                        default=_AWS_DEFAULTS["max_attempts"].default, metavar="N",
                        help="attempts per EC2 call (standard retry mode)")
    common.add_argument("--json", action="store_true", help="JSON lines for machines")

    pool = sub.add_parser("pool", help="operate the pool of warm volumes (AWS credentials)")
    psub = pool.add_subparsers(dest="pool_command", required=True, metavar="SUBCOMMAND")
    pool_name = _checked("pool", "name")

    create = psub.add_parser("create", parents=[common],
                             help="create volumes in the pool (tagged at creation)")
    create.add_argument("--pool", required=True, type=pool_name, metavar="NAME")
    create.add_argument("--az", required=True, metavar="AZ", help="availability zone")
    create.add_argument("--count", type=_count, default=1, metavar="N")
    create.add_argument("--size", type=_checked("pool", "size_gib", integer=True), default=None,
                        metavar="GiB", help="size (default: the snapshot's size, or "
                        f"{_POOL_DEFAULTS['size_gib'].default} GiB for an empty volume)")
    src = create.add_mutually_exclusive_group()
    src.add_argument("--snapshot-id", type=_checked("pool", "snapshot_id"), default=None,
                     metavar="ID")
    src.add_argument("--from-ami", type=_checked("pool", "from_ami"), default=None,
                     metavar="AMI", help="use this AMI's root snapshot")
    create.add_argument("--type", dest="volume_type",
                        type=_checked("pool", "volume_type"),
                        default=_POOL_DEFAULTS["volume_type"].default, metavar="TYPE",
                        help="gp3 (default), gp2, io1, io2")
    create.add_argument("--iops", type=_checked("pool", "iops", integer=True),
                        default=_POOL_DEFAULTS["iops"].default, metavar="N")
    create.add_argument("--throughput", type=_checked("pool", "throughput", integer=True),
                        default=_POOL_DEFAULTS["throughput"].default, metavar="MiB/s")
    create.add_argument("--init-rate", type=_init_rate, default=volumes.DEFAULT_INIT_RATE_MIB,
                        metavar="MiB/s", help="volume initialization rate for volumes from a "
                        f"snapshot (billed; 0 = EC2's default; default "
                        f"{volumes.DEFAULT_INIT_RATE_MIB})")
    create.add_argument("--wait-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="longest wait for the volumes to become available")
    create.set_defaults(handler=cmd_create)

    lst = psub.add_parser("list", parents=[common], help="one line per pool volume")
    lst.add_argument("--pool", type=pool_name, default=None, metavar="NAME",
                     help="only this pool (default: every spotagent pool)")
    lst.set_defaults(handler=cmd_list)

    rel = psub.add_parser("release", parents=[common],
                          help="clear a stale claim (the owner instance is gone)")
    rel.add_argument("volume", type=_volume_id, metavar="VOLUME")
    rel.set_defaults(handler=cmd_release)

    azs = psub.add_parser("azs", parents=[common],
                          help="AZs with free volumes (warm ones first), to aim spot requests")
    azs.add_argument("--pool", required=True, type=pool_name, metavar="NAME")
    azs.set_defaults(handler=cmd_azs)


# --- handlers ----------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> EC2Client:
    # AWS_REGION as the help promises (botocore itself reads only AWS_DEFAULT_REGION and the
    # profile, as boto3's Session().region_name did here before).
    region = (args.region or os.environ.get("AWS_REGION")
              or botocore.session.get_session().get_config_variable("region"))
    if not region:
        raise UsageError("no AWS region: pass --region or set AWS_REGION")
    return ec2.client(region=region, endpoint_url=args.endpoint_url,
                      connect_timeout=_AWS_DEFAULTS["connect_timeout"].default,
                      read_timeout=_AWS_DEFAULTS["read_timeout"].default,
                      max_attempts=args.max_attempts, model="full")


def cmd_create(args: argparse.Namespace) -> int:
    size = args.size
    if size is None and not (args.snapshot_id or args.from_ami):
        size = _POOL_DEFAULTS["size_gib"].default
    spec = volumes.VolumeSpec(volume_type=args.volume_type, size_gib=size, iops=args.iops,
                              throughput=args.throughput, snapshot_id=args.snapshot_id,
                              from_ami=args.from_ami, init_rate_mib=args.init_rate or None)
    pool = volumes.Pool(_client(args), args.pool, spec=spec, create_timeout=args.wait_timeout)
    _print(pool.create_volumes(args.az, args.count), args.json)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.pool:
        vols = volumes.Pool(client, args.pool).volumes()
    else:
        vols = volumes.all_pool_volumes(client)
    _print(vols, args.json)
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    _print([volumes.release_stale_claim(_client(args), args.volume)], args.json)
    return 0


def cmd_azs(args: argparse.Namespace) -> int:
    counts = volumes.Pool(_client(args), args.pool).free_by_az()
    rows = sorted(counts.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    if args.json:
        for az, (free, warm) in rows:
            _out(json.dumps({"pool": args.pool, "az": az, "free": free, "warm": warm}))
    else:
        _out(f"{'AZ':<16} {'FREE':>5} {'WARM':>5}")
        for az, (free, warm) in rows:
            _out(f"{az:<16} {free:>5} {warm:>5}")
    return 0


# --- output ------------------------------------------------------------------------------------

_COLUMNS = (("VOLUME", 21), ("POOL", 16), ("AZ", 14), ("STATE", 9), ("OWNER", 19), ("GEN", 4),
            ("STEP", 9), ("WARM", 5), ("DONE", 5))


def _row(v: volumes.Volume) -> list[str]:
    def yn(b: bool) -> str:
        return "yes" if b else "no"

    step = v.checkpoint_step
    return [v.volume_id, v.pool or "-", v.az, v.state, v.owner or "-", str(v.generation),
            "-" if step is None else str(step), yn(v.warm), yn(v.done)]


def _print(vols: Iterable[volumes.Volume], as_json: bool) -> None:
    if as_json:
        for v in vols:
            _out(json.dumps(v.as_dict()))
        return
    _out(" ".join(f"{name:<{width}}" for name, width in _COLUMNS).rstrip())
    for v in vols:
        _out(" ".join(f"{cell:<{w}}" for cell, (_n, w) in zip(_row(v), _COLUMNS,
                                                                  strict=True)).rstrip())


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")
