"""Host-memory snapshots of tensors: the device boundary of a save.

The training thread blocks only while tensors are copied into one reusable host buffer (pinned
when CUDA is present, so device-to-host copies are asynchronous DMA); the buffer is pre-faulted
off the critical path so the first save does not pay for page faults either.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import torch

from .codec import Encoded


def cuda_present() -> bool:
    """True when a CUDA device is usable (pinned buffers and CUDA RNG states then apply)."""
    return bool(torch.cuda.is_available())


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of the bytes of contiguous CPU tensor `t` (no copy, no numpy).

    The view references the tensor's memory directly: keep `t` alive while the view is used.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    arr = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    return memoryview(arr).cast("B")


class HostBuffer:
    """One growable host buffer for snapshots; reused across saves (one save in flight)."""

    def __init__(self, pinned: bool | None = None) -> None:
        self.pinned = cuda_present() if pinned is None else pinned
        self._buf: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    def reserve(self, nbytes: int) -> torch.Tensor:
        """Ensure capacity for `nbytes` (touching every page now) and return the buffer."""
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # free the old one before allocating the larger one
            # 1/16 headroom so a state that grows a little does not reallocate every save.
            size = max(nbytes + nbytes // 16, 1)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            buf.zero_()  # pre-fault: page faults happen here, not inside the next stall
            self._buf = buf
        return self._buf

    def release(self) -> None:
        self._buf = None


def copy_into(encoded: Encoded, buf: torch.Tensor,
              indices: Iterable[int] | None = None) -> torch.Tensor:
    """Copy tensors of `encoded` (all, or those at `indices`) into `buf` at their offsets;
    return the used prefix of `buf`.

    Device tensors are copied with non_blocking=True into the pinned buffer and waited for once
    at the end (an event on the current stream, not a device-wide synchronize), so the copy is
    one pass over the state at memory / PCIe bandwidth.
    """
    device_copy = False
    for i in range(len(encoded.records)) if indices is None else indices:
        rec, src = encoded.records[i], encoded.sources[i]
        if rec.nbytes == 0:
            continue
        dst = buf[rec.offset:rec.offset + rec.nbytes]
        on_device = src.device.type != "cpu"
        device_copy = device_copy or on_device
        dst.copy_(src, non_blocking=on_device)
    if device_copy:
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        done.synchronize()
    return buf[:encoded.total_bytes]
