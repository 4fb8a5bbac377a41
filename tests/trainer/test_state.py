"""Exact-resume state: RNGs, registered objects, sampler position and data order."""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from spottrainer import Session, TrainState
from spottrainer.data import ResumableSampler, iterate
from spottrainer.dist import Dist


def draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]


def test_every_rng_and_registered_object_round_trips(tmp_path: Path) -> None:
    counter = Counter()
    state = TrainState()
    state.register("counter", counter)
    session = Session(state, tmp_path, install_signal_handlers=False, dist=Dist())
    session.restore()
    counter.n = 41
    session.step_done()
    assert session.finish() == 0  # commits step 1 synchronously
    expected = draws()
    counter.n = 0
    draws()

    fresh_counter = Counter()
    fresh = TrainState()
    fresh.register("counter", fresh_counter)
    step = Session(fresh, tmp_path, install_signal_handlers=False, dist=Dist()).restore()
    assert step == 1 and fresh_counter.n == 41
    assert draws() == expected


def test_sampler_matches_distributed_sampler_and_resumes_mid_epoch() -> None:
    data = list(range(50))
    for rank in (0, 1):
        ours = ResumableSampler(data, num_replicas=2, rank=rank, seed=3)
        ref = DistributedSampler(data, num_replicas=2, rank=rank, seed=3)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref)
    s = ResumableSampler(data, seed=3)
    full = list(s)
    s.advance(20)
    saved = s.state_dict()
    t = ResumableSampler(data, seed=3)
    t.load_state_dict(saved)
    assert list(t) == full[20:] and len(t) == 30


def test_iterate_resumes_data_order_exactly_across_epochs() -> None:
    data = torch.arange(30)

    def loader(sampler: ResumableSampler) -> DataLoader[Any]:
        return DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)

    s = ResumableSampler(data, seed=1)
    it = iterate(loader(s), s)
    straight = [next(it).tolist() for _ in range(20)]  # 7 batches per epoch: ~3 epochs

    s2 = ResumableSampler(data, seed=1)
    it2 = iterate(loader(s2), s2)
    first = [next(it2).tolist() for _ in range(9)]
    saved = s2.state_dict()
    assert saved["epoch"] == 1 and saved["position"] == 8
    torch.manual_seed(0)
    before = torch.get_rng_state()
    s3 = ResumableSampler(data, seed=1)
    s3.load_state_dict(saved)
    it3 = iterate(loader(s3), s3)
    rest = [next(it3).tolist() for _ in range(11)]
    assert first + rest == straight
    assert torch.equal(torch.get_rng_state(), before), "iterate() drew from the global RNG"


def test_restored_optimizer_does_not_pin_the_checkpoint_file(tmp_path: Path) -> None:
    """Loaded tensors (>= 1 MiB) map tensors.bin; after restore nothing may keep that mapping (it
    would hold the disk blocks of a checkpoint that retention deletes)."""
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    session = Session(TrainState(model=model, optimizer=opt), tmp_path,
                      install_signal_handlers=False, dist=Dist())
    session.restore()
    session.step_done()
    assert session.finish() == 0

    model2 = torch.nn.Linear(1024, 1024)
    opt2 = torch.optim.Adam(model2.parameters())
    assert Session(TrainState(model=model2, optimizer=opt2), tmp_path,
                   install_signal_handlers=False, dist=Dist()).restore() == 1
    gc.collect()
    maps = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(tmp_path) not in maps
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
