"""Resumable data order: a DistributedSampler that knows its epoch and position.

`ResumableSampler` yields exactly the indices `torch.utils.data.DistributedSampler` would for the
same (seed, epoch, num_replicas, rank), starting at `position` within the epoch. `iterate()`
drives a DataLoader over epochs forever and advances the position as batches are handed to the
training loop, so a checkpoint taken at a step boundary records exactly what was consumed
(prefetched-but-unused batches are not counted). `worker_init_fn` makes data-loader workers
ignore the agent's signals.

Exactness needs per-sample randomness (augmentation) to be a function of (seed, epoch, index),
not of a worker's RNG: after a resume, batches land on different workers.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ._compat import np as _np
from ._log import event
from .protocol import ignore_agent_signals


class ResumableSampler(DistributedSampler[int]):
    """DistributedSampler + `position` (indices of this rank already consumed this epoch)."""

    def __init__(self, dataset: Dataset[Any], *, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle,
                         seed=seed, drop_last=drop_last)
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.position:])

    def __len__(self) -> int:
        return int(self.num_samples) - self.position

    def advance(self, n: int) -> None:
        self.position = min(self.position + n, int(self.num_samples))

    def next_epoch(self) -> None:
        self.set_epoch(int(self.epoch) + 1)
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": int(self.epoch), "position": self.position, "seed": int(self.seed),
                "num_samples": int(self.num_samples), "num_replicas": int(self.num_replicas)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("seed"), state.get("num_samples")) != (self.seed, self.num_samples):
            event(logging.WARNING, "sampler_changed", saved_seed=state.get("seed"),
                  seed=self.seed, saved_num_samples=state.get("num_samples"),
                  num_samples=self.num_samples, action="data order will not match the saved run")
        self.set_epoch(int(state["epoch"]))
        self.position = min(int(state["position"]), int(self.num_samples))


def iterate(loader: DataLoader[Any], sampler: ResumableSampler) -> Iterator[Any]:
    """Yield batches of `loader` (built with `sampler`) across epochs, forever.

    The sampler's position advances by the batch size as each batch is yielded: a checkpoint
    at the next step boundary then records the batch as consumed. The loader gets its own
    generator, reseeded per epoch, so creating an iterator (at resume) does not draw from the
    global torch RNG.
    """
    batch_size = loader.batch_size
    if batch_size is None:
        raise ValueError("iterate() needs a DataLoader with batch_size set")
    if loader.generator is None:
        loader.generator = torch.Generator()
    while True:
        if sampler.position >= sampler.num_samples:
            sampler.next_epoch()
        loader.generator.manual_seed(int(sampler.seed) * 1_000_003 + int(sampler.epoch))
        for batch in loader:
            sampler.advance(batch_size)
            yield batch
        sampler.next_epoch()


def worker_init_fn(worker_id: int) -> None:
    """DataLoader worker set-up: ignore SIGTERM/SIGUSR1/SIGINT, seed `random` and numpy."""
    ignore_agent_signals()
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    if _np is not None:
        _np.random.seed(seed)
    del worker_id
