"""Capture and restore every random number generator a training step may draw from.

Python's `random`, NumPy's global generator (when numpy is importable), torch's CPU generator
and, when CUDA is initialised, every CUDA device's generator.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from ._compat import np as _np
from ._log import event


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if _np is not None:
        state["numpy"] = _np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].clone())
    if "numpy" in state and _np is not None:
        _np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([t.clone() for t in saved])
        else:
            event(logging.WARNING, "cuda_rng_not_restored", saved_devices=len(saved),
                  devices=torch.cuda.device_count())
