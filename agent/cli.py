"""Command line: parse arguments and wire the modules together; decides nothing itself."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from spotagent import config as configmod
from spotagent import log
from spotagent.errors import ConfigError, SpotagentError

Handler = Callable[[argparse.Namespace], int]


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, metavar="PATH",
                   help=f"config file (default {configmod.DEFAULT_CONFIG_PATH}, optional)")


def _metadata_factory(args: argparse.Namespace) -> Callable[[configmod.Config],
                                                             configmod.MetadataSource] | None:
    """How `config check` reaches user data and tags: IMDS, local files, or not at all."""
    if args.user_data is not None or args.tag:
        return lambda _cfg: _LocalMetadata(args.user_data, args.tag)
    if args.no_imds:
        return None
    from spotagent.imds import ImdsClient

    return lambda cfg: ImdsClient(cfg.imds.url, timeout=cfg.imds.timeout)


class _LocalMetadata:
    """User data and tags given on the command line (to check them before a launch)."""

    def __init__(self, user_data: Path | None, tags: Sequence[str]) -> None:
        self._user_data = user_data
        self._tags = tags

    def user_data(self) -> bytes | None:
        if self._user_data is None:
            return None
        try:
            return self._user_data.read_bytes()
        except OSError as exc:
            raise SpotagentError("cannot read user data file", path=self._user_data,
                                 error=exc.strerror) from exc

    def instance_tags(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in self._tags:
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"config error: --tag {item!r}: expected KEY=VALUE")
            out[key] = value
        return out


def cmd_config_check(args: argparse.Namespace) -> int:
    cfg = configmod.gather(args.config, _metadata_factory(args))
    if args.json:
        print(json.dumps({"values": cfg.as_dict(),
                          "sources": {n: s for n, _v, s in cfg.items()}}, indent=2))
    else:
        print(configmod.render(cfg))
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `spotagent` parser. With `command` (the first argument), only the module of that
    command is imported and registered: `spotagent run` does not pay for the operator's, the
    testbed's or the demo's imports. Without one (`--help`, a typo), every command is there."""
    parser = argparse.ArgumentParser(
        prog="spotagent",
        description="Dependable deep-learning training on EC2 Spot from a pool of warm volumes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    check = cfg_sub.add_parser(
        "check", help="validate and print the effective configuration with each value's source")
    _add_config_arg(check)
    src = check.add_mutually_exclusive_group()
    src.add_argument("--no-imds", action="store_true",
                     help="do not read user data and tags from the metadata service")
    check.add_argument("--user-data", type=Path, default=None, metavar="FILE",
                       help="check this user data instead of the instance's (implies no IMDS)")
    check.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                       help="an instance tag to check (repeatable; implies no IMDS)")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(handler=cmd_config_check)

    if command == "config":
        return parser
    wanted = [_COMMANDS[command]] if command in _COMMANDS else list(
        dict.fromkeys(_COMMANDS.values()))
    for module in wanted:
        importlib.import_module(module).register(sub)
    return parser


# The commands other modules add (each module's `register(sub)` adds all of its own), in the
# order of the help. A module is imported only when one of its commands runs.
_COMMANDS: dict[str, str] = {
    "run": "spotagent.agent_cli",
    "status": "spotagent.agent_cli",
    "drain": "spotagent.agent_cli",
    "release": "spotagent.agent_cli",
    "pool": "spotagent.pool_cli",
    "testbed": "spotagent.testbed_cli",
    "demo": "spotagent.demo",
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = args_list[0] if args_list and not args_list[0].startswith("-") else None
    parser = build_parser(command)
    args = parser.parse_args(args_list)
    log.configure()
    handler: Handler = args.handler
    try:
        return handler(args)
    except SpotagentError as exc:
        print(f"spotagent: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
