"""`python -m spottrainer latest|verify DIR`: inspect a checkpoint root (read-only)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import SpottrainerError
from .store import CheckpointStore


def _say(line: str, *, err: bool = False) -> None:
    (sys.stderr if err else sys.stdout).write(line + "\n")


def _latest(root: Path, as_json: bool) -> int:
    store = CheckpointStore(root)
    for ref in reversed(store.committed()):
        result = store.verify(ref.path)
        if result.ok:
            if as_json:
                _say(json.dumps({"step": result.step, "path": str(result.path)}))
            else:
                _say(f"step={result.step} path={result.path}")
            return 0
        _say(f"invalid step={result.step} path={result.path} problem={result.problem}", err=True)
    _say(f"no valid checkpoint in {root}", err=True)
    return 1


def _verify(root: Path, as_json: bool) -> int:
    store = CheckpointStore(root)
    refs = store.committed()
    if not refs:
        _say(f"no checkpoint in {root}", err=True)
        return 1
    results = [store.verify(ref.path) for ref in refs]
    for r in results:
        if as_json:
            _say(json.dumps({"step": r.step, "path": str(r.path), "ok": r.ok,
                              "problem": r.problem, "bytes": r.bytes}))
        elif r.ok:
            _say(f"ok step={r.step} bytes={r.bytes} path={r.path}")
        else:
            _say(f"INVALID step={r.step} path={r.path} problem={r.problem}")
    try:
        pointer = store.read_latest_pointer()
        if pointer is not None and pointer.step != refs[-1].step:
            _say(f"note: latest pointer names step {pointer.step}, newest is {refs[-1].step}",
                 err=True)
    except SpottrainerError as err:
        _say(f"note: {err}", err=True)
    return 0 if results[-1].ok else 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spottrainer",
                                     description="Inspect a spottrainer checkpoint directory.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_latest = sub.add_parser("latest", help="newest valid checkpoint (exit 1 when none)")
    p_latest.add_argument("dir", type=Path)
    p_latest.add_argument("--json", action="store_true")
    p_verify = sub.add_parser("verify", help="verify every checkpoint (exit 2 if newest is bad)")
    p_verify.add_argument("dir", type=Path)
    p_verify.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "latest":
            return _latest(args.dir, args.json)
        return _verify(args.dir, args.json)
    except SpottrainerError as err:
        _say(f"error: {err}", err=True)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
