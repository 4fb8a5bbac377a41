"""The few collectives a checkpointing job needs under torch.distributed (no-ops when single)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: str = "cpu"  # where flag tensors live (cuda for NCCL)

    @staticmethod
    def detect() -> Dist:
        if not (tdist.is_available() and tdist.is_initialized()):
            return Dist()
        backend = str(tdist.get_backend())
        device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        return Dist(tdist.get_rank(), tdist.get_world_size(), device)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def max_flags(self, flags: list[int]) -> list[int]:
        """Element-wise max of `flags` over all ranks (so every rank takes the same decision)."""
        if self.world == 1:
            return flags
        t = torch.tensor(flags, dtype=torch.int64, device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        tdist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]
