"""The on-instance commands: `spotagent run | status | drain | release`."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from spotagent import config as configmod
from spotagent import status as statusmod
from spotagent.errors import ConfigError, SpotagentError


def _load(args: argparse.Namespace, *, with_metadata: bool) -> configmod.Config:
    metadata = None
    if with_metadata:
        from spotagent.imds import ImdsClient

        def metadata(cfg: configmod.Config) -> configmod.MetadataSource:
            return ImdsClient(cfg.imds.url, timeout=cfg.imds.timeout)

    return configmod.gather(args.config, metadata)


def cmd_run(args: argparse.Namespace) -> int:
    from spotagent import ec2
    from spotagent.imds import ImdsClient
    from spotagent.monitors import default_monitors
    from spotagent.runner import Runner
    from spotagent.volumes import Pool

    cfg = _load(args, with_metadata=True)
    imds = ImdsClient(cfg.imds.url, timeout=cfg.imds.timeout)
    identity = imds.identity()
    client = ec2.client_from_config(cfg, region=identity.region)
    pool = Pool.from_config(cfg, client)
    # Monitors get their own client with one attempt: the next poll, a moment later, is the
    # retry, and a hung IMDS must not stall the loop for several seconds.
    monitor_imds = ImdsClient(cfg.imds.url, timeout=min(float(cfg.imds.timeout), 1.0),
                              retries=1)
    runner = Runner(cfg, imds=imds, pool=pool, monitors=default_monitors(monitor_imds),
                    identity=identity)
    return runner.run()


def _state_dir(args: argparse.Namespace) -> Path:
    if args.state_dir is not None:
        return Path(args.state_dir)
    try:
        return Path(_load(args, with_metadata=False).agent.state_dir)
    except ConfigError:
        # status must work even where the config needs user data to be complete
        return Path(str(configmod.SCHEMA["agent"]["state_dir"].default))


def cmd_status(args: argparse.Namespace) -> int:
    st = statusmod.read(_state_dir(args))
    if st is None:
        raise SpotagentError("no agent state here (is spotagent running?)",
                             state_dir=_state_dir(args))
    if args.json:
        doc: dict[str, Any] = st.to_json()
        doc["summary"] = st.summary()
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(st.summary())
        print(statusmod.render(st))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """Ask the running agent to checkpoint and release (as a systemd stop would)."""
    state_dir = _state_dir(args)
    st = statusmod.read(state_dir)
    if st is None or not _alive(st.agent_pid):
        raise SpotagentError("no running agent to drain", state_dir=state_dir)
    req = state_dir / "drain-request"
    req.write_text(str(time.time()))
    print(f"drain requested from agent pid {st.agent_pid}")
    if not args.wait:
        return 0
    end = time.monotonic() + args.timeout
    while time.monotonic() < end:
        st = statusmod.read(state_dir)
        if st is not None and st.state in ("released", "completed", "failed"):
            print(st.summary())
            return 0 if st.state != "failed" else 1
        time.sleep(0.2)
    raise SpotagentError("agent did not finish draining in time", timeout=args.timeout)


def cmd_release(args: argparse.Namespace) -> int:
    """Release this instance's volume by hand when no agent is running (after a crash)."""
    from spotagent import ec2
    from spotagent.imds import ImdsClient
    from spotagent.runner import release_leftovers
    from spotagent.volumes import Pool

    cfg = _load(args, with_metadata=True)
    st = statusmod.read(Path(cfg.agent.state_dir))
    if st is not None and _alive(st.agent_pid) and st.agent_pid != os.getpid() and \
            st.state not in ("released", "completed", "failed"):
        raise SpotagentError("the agent is running: use `spotagent drain`", pid=st.agent_pid)
    imds = ImdsClient(cfg.imds.url, timeout=cfg.imds.timeout)
    identity = imds.identity()
    pool = Pool.from_config(cfg, ec2.client_from_config(cfg, region=identity.region))
    released = release_leftovers(cfg, pool, identity.instance_id)
    print(f"released {released}" if released else "nothing to release")
    return 0


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def cfg_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", type=Path, default=None, metavar="PATH",
                       help=f"config file (default {configmod.DEFAULT_CONFIG_PATH})")

    run = sub.add_parser("run", help="the agent: claim, mount, chroot, train, drain, release")
    cfg_arg(run)
    run.set_defaults(handler=cmd_run)

    st = sub.add_parser("status", help="what the agent on this instance is doing")
    cfg_arg(st)
    st.add_argument("--state-dir", default=None, help="read this state directory")
    st.add_argument("--json", action="store_true")
    st.set_defaults(handler=cmd_status)

    dr = sub.add_parser("drain", help="checkpoint now and release the volume")
    cfg_arg(dr)
    dr.add_argument("--state-dir", default=None)
    dr.add_argument("--wait", action="store_true", help="wait until the volume is released")
    dr.add_argument("--timeout", type=float, default=180.0)
    dr.set_defaults(handler=cmd_drain)

    rel = sub.add_parser("release", help="release this instance's volume (no agent running)")
    cfg_arg(rel)
    rel.set_defaults(handler=cmd_release)
