"""The one place the agent runs external commands: argv lists, a timeout, typed errors."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spotagent.errors import SubprocessError

DEFAULT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def run(
    argv: Sequence[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    check: bool = True,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
    ok_codes: Sequence[int] = (0,),
) -> Result:
    """Run `argv` (never through a shell) and return its output.

    Raises SubprocessError when the command cannot start, times out, or (with `check`) exits
    with a code outside `ok_codes`; the error carries the command, the code and stderr's tail.
    """
    if isinstance(argv, str):
        raise TypeError("subp.run takes an argv list, not a string")
    args = tuple(str(a) for a in argv)
    try:
        proc = subprocess.run(  # noqa: S603 - argv list, no shell
            args,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            env=dict(env) if env is not None else None,
            check=False,
        )
    except FileNotFoundError as exc:
        raise SubprocessError("command not found", argv=" ".join(args)) from exc
    except subprocess.TimeoutExpired as exc:
        raise SubprocessError("command timed out", argv=" ".join(args), timeout=timeout) from exc
    result = Result(args, proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode not in ok_codes:
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        raise SubprocessError(
            "command failed",
            argv=" ".join(args),
            code=proc.returncode,
            stderr=tail[0][:300],
        )
    return result
