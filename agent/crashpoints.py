"""Test hook: make the agent die at a named point of claim, mount and release.

`SPOTAGENT_TEST_CRASH_AT=<point>` makes `crash_point(<point>)` SIGKILL the calling process (an
agent killed by the kernel, the OOM killer or `kill -9` at exactly that point); with
`<point>:raise` it raises `InjectedCrash` the first time the point is passed, an exception the
agent does not expect (a bug).
The tests in tests/test_agent_crash.py restart the agent without the variable and check that
it converges: no double attach, no leaked claim, no mounted-but-detached volume.

Points: after_attach, after_tag (spotagent.volumes, during a claim), after_mount,
after_chroot (spotagent.runner, on the way up), after_unmount (runner, during a release),
after_detach (volumes, during a release). Unset (always, in production) it does nothing.
"""

from __future__ import annotations

import os
import signal

ENV = "SPOTAGENT_TEST_CRASH_AT"
POINTS = frozenset({"after_attach", "after_tag", "after_mount", "after_chroot", "after_unmount",
                    "after_detach"})


_raised: set[str] = set()


class InjectedCrash(RuntimeError):
    """Raised at a crash point in `:raise` mode: deliberately not a SpotagentError."""


def crash_point(name: str) -> None:
    """Die here if the test hook names this point (see the module docstring)."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}")
    wanted = os.environ.get(ENV, "")
    if not wanted:
        return
    point, _, mode = wanted.partition(":")
    if point != name:
        return
    if mode == "raise":
        if name in _raised:
            return   # once per process: the agent's own recovery passes the point again
        _raised.add(name)
        raise InjectedCrash(f"injected crash at {name} ({ENV})")
    os.kill(os.getpid(), signal.SIGKILL)
