"""The state file: what the running agent persists and `spotagent status` reads.

One JSON document, replaced atomically (write to a temporary file, fsync, rename), so a reader
never sees half a file and a restarted agent can resume where it was.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotagent.errors import SpotagentError

STATE_FILE = "state.json"
FORMAT = 1

# Timeline phases, in the order a boot passes them (`spotagent status` shows them so).
PHASES = ("start", "claimed", "mounted", "trainer_started", "first_step", "notice",
          "checkpoint_committed", "trainer_exited", "unmounted", "volume_available")


class StatusError(SpotagentError):
    pass


@dataclass
class AgentStatus:
    state: str = "starting"
    cause: str = ""
    instance_id: str | None = None
    availability_zone: str | None = None
    pool: str | None = None
    volume_id: str | None = None
    generation: int | None = None
    device: str | None = None
    mount_point: str | None = None
    trainer_pid: int | None = None
    restart_count: int = 0
    step: int | None = None
    samples_per_s: float | None = None
    loss: float | None = None
    last_committed_step: int | None = None
    last_commit_time: float | None = None
    notice: str | None = None
    deadline: float | None = None
    warmup: str | None = None
    error: str | None = None
    agent_pid: int = field(default_factory=os.getpid)
    boot_id: str | None = None
    updated: float = 0.0
    timeline: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str, when: float | None = None) -> None:
        """Record a phase of this boot once (the first time it happens)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase}")
        self.timeline.setdefault(phase, when if when is not None else _now())

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["format"] = FORMAT
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AgentStatus:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})

    def summary(self) -> str:
        """The one line for systemd's STATUS= and the first line of `spotagent status`."""
        parts = [self.state]
        if self.volume_id:
            parts.append(f"volume {self.volume_id}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.samples_per_s:
            parts.append(f"{self.samples_per_s:.1f} samples/s")
        if self.last_commit_time:
            age = max(0.0, _now() - self.last_commit_time)
            parts.append(f"checkpoint {self.last_committed_step} {_age(age)} ago")
        if self.warmup:
            parts.append(f"warm-up {self.warmup}")
        if self.notice:
            parts.append(f"notice {self.notice}")
        if self.deadline:
            parts.append(f"deadline in {max(0.0, self.deadline - _now()):.0f}s")
        if self.error:
            parts.append(f"error: {self.error}")
        return ", ".join(parts)


def _now() -> float:
    return datetime.now(UTC).timestamp()


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def write(state_dir: Path, status: AgentStatus) -> None:
    status.updated = _now()
    state_dir.mkdir(parents=True, exist_ok=True)
    data = json.dumps(status.to_json(), indent=1, sort_keys=True).encode()
    fd, tmp = tempfile.mkstemp(prefix=".state.", dir=state_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, state_dir / STATE_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(state_dir: Path) -> AgentStatus | None:
    path = state_dir / STATE_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StatusError("cannot read the state file", path=path, error=str(exc)) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StatusError("state file has an unknown format", path=path)
    return AgentStatus.from_json(doc)


def render(status: AgentStatus) -> str:
    """`spotagent status` for a person."""
    def ts(t: float | None) -> str:
        return "-" if t is None else datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]

    rows = [
        ("state", f"{status.state} ({status.cause})" if status.cause else status.state),
        ("instance", f"{status.instance_id or '-'} in {status.availability_zone or '-'}"),
        ("volume", f"{status.volume_id or '-'}"
         + (f" (pool {status.pool}, generation {status.generation})" if status.volume_id else "")),
        ("mount", f"{status.device or '-'} on {status.mount_point or '-'}"),
        ("trainer", f"pid {status.trainer_pid or '-'}, restarts {status.restart_count}"),
        ("step", "-" if status.step is None else
         f"{status.step} ({status.samples_per_s or 0:.1f} samples/s, loss {status.loss})"),
        ("checkpoint", "-" if status.last_committed_step is None else
         f"step {status.last_committed_step} at {ts(status.last_commit_time)}"),
        ("notice", status.notice or "-"),
        ("deadline", ts(status.deadline)),
    ]
    if status.warmup:
        rows.append(("warm-up", status.warmup))
    if status.error:
        rows.append(("error", status.error))
    out = [f"{k:<11} {v}" for k, v in rows]
    out.append("timeline:")
    start = status.timeline.get("start")
    for phase in PHASES:
        t = status.timeline.get(phase)
        if t is not None:
            rel = f"+{t - start:8.3f}s" if start is not None else ""
            out.append(f"  {ts(t)}  {rel}  {phase}")
    return "\n".join(out)
