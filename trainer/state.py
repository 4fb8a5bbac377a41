"""TrainState: the objects whose state makes a resume exact, gathered into one state tree.

Global state (identical on every rank under DDP, saved once by rank 0): step, model, optimizer,
LR scheduler, AMP grad scaler and anything registered with `register()`. Rank-local state (one
entry per rank): every RNG and the data sampler's epoch/position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from . import rng
from ._log import event
from .errors import CheckpointError


@runtime_checkable
class Stateful(Protocol):
    """Anything with the state_dict / load_state_dict protocol."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def _own_tensors(tree: Any) -> Any:
    """`tree` with every tensor copied into its own memory.

    Loaded tensors are views of the checkpoint file mapped copy-on-write; objects that keep the
    tensors they are given (optimizer state, user objects) would otherwise pin the mapping, and
    with it the file's disk blocks after retention deletes that checkpoint.
    """
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _own_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_own_tensors(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_own_tensors(v) for v in tree)
    return tree


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel / DataParallel wrappers (plain keys on disk)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


@dataclass
class TrainState:
    """What a checkpoint holds. `step` counts completed optimizer steps."""

    model: torch.nn.Module | None = None
    optimizer: Stateful | None = None
    scheduler: Stateful | None = None
    scaler: Stateful | None = None
    sampler: Stateful | None = None
    extra: dict[str, Stateful] = field(default_factory=dict)
    step: int = 0
    capture_rng: bool = True

    def register(self, name: str, obj: Stateful) -> None:
        """Add a user object (state_dict / load_state_dict) under `name`."""
        if not isinstance(obj, Stateful):
            raise CheckpointError(f"{name}: object has no state_dict/load_state_dict")
        if name in self.extra:
            raise CheckpointError(f"{name}: already registered")
        self.extra[name] = obj

    def capture_global(self) -> dict[str, Any]:
        tree: dict[str, Any] = {"step": self.step}
        if self.model is not None:
            tree["model"] = unwrap_model(self.model).state_dict()
        for name in ("optimizer", "scheduler", "scaler"):
            obj = getattr(self, name)
            if obj is not None:
                tree[name] = obj.state_dict()
        tree["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        return tree

    def capture_local(self) -> dict[str, Any]:
        local: dict[str, Any] = {}
        if self.capture_rng:
            local["rng"] = rng.capture()
        if self.sampler is not None:
            local["sampler"] = self.sampler.state_dict()
        return local

    def capture(self, ranks: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The whole state tree; `ranks` is every rank's capture_local() (default: this one)."""
        tree = self.capture_global()
        tree["ranks"] = ranks if ranks is not None else [self.capture_local()]
        return tree

    def apply(self, tree: dict[str, Any], rank: int = 0) -> None:
        """Load a state tree captured by `capture()` into the live objects."""
        self.step = int(tree["step"])
        if self.model is not None:
            unwrap_model(self.model).load_state_dict(tree["model"])
        for name in ("optimizer", "scheduler", "scaler"):
            obj = getattr(self, name)
            if obj is not None:
                if name not in tree:
                    raise CheckpointError(f"checkpoint has no {name} state")
                obj.load_state_dict(_own_tensors(tree[name]))
        saved_extra = tree.get("extra", {})
        for name, obj in self.extra.items():
            if name not in saved_extra:
                raise CheckpointError(f"checkpoint has no state for registered object {name!r}")
            obj.load_state_dict(_own_tensors(saved_extra[name]))
        ranks = tree.get("ranks") or [{}]
        if rank >= len(ranks):
            event(logging.WARNING, "world_size_changed", saved_ranks=len(ranks), rank=rank,
                  action="using rank 0's RNG and data position")
        local = ranks[rank] if rank < len(ranks) else ranks[0]
        if self.capture_rng and "rng" in local:
            rng.restore(local["rng"])
        if self.sampler is not None and "sampler" in local:
            self.sampler.load_state_dict(local["sampler"])
