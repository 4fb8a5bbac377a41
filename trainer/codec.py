"""State tree <-> (JSON skeleton, tensor table): the pure part of the checkpoint format.

A state tree is what `state_dict()` methods return: dicts, lists, tuples, scalars, strings,
bytes, tensors and numpy arrays. Tensors are pulled out into a table (dtype, shape, byte offset in
`tensors.bin`); everything else becomes tagged JSON, so loading a checkpoint never executes code
(unlike pickle). Unsupported objects fail at save time with the path of the offending entry.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import torch

from ._compat import np as _np
from .errors import CheckpointError

ALIGN = 64  # byte alignment of every tensor in tensors.bin (dtype views need aligned offsets)
TAG = "__t"


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes live in tensors.bin and how to view them."""

    dtype: str          # torch dtype name ("float32") or numpy dtype str ("<u4") for kind numpy
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    kind: str = "torch"  # "torch" | "numpy"
    device: str = "cpu"  # where the tensor lived when saved (informational)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "kind": self.kind, "device": self.device}

    @staticmethod
    def from_json(obj: Any) -> TensorRecord:
        try:
            return TensorRecord(
                dtype=str(obj["dtype"]), shape=tuple(int(s) for s in obj["shape"]),
                offset=int(obj["offset"]), nbytes=int(obj["nbytes"]),
                kind=str(obj.get("kind", "torch")), device=str(obj.get("device", "cpu")))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"bad tensor record {obj!r}") from err


@dataclass
class Encoded:
    """A state tree split into its JSON skeleton and its tensors (as flat uint8 views)."""

    skeleton: Any
    records: list[TensorRecord]
    sources: list[torch.Tensor]  # 1-D uint8 views of each tensor's bytes (any device)
    total_bytes: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32"); CheckpointError for anything else."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r}")
    return value


def _flat_bytes(t: torch.Tensor, where: str) -> torch.Tensor:
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
        raise CheckpointError(f"cannot checkpoint {where}: unsupported tensor ({t.layout}, "
                              f"device {t.device})")
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class _Encoder:
    def __init__(self) -> None:
        self.records: list[TensorRecord] = []
        self.sources: list[torch.Tensor] = []
        self.offset = 0

    def _add(self, flat: torch.Tensor, dtype: str, shape: tuple[int, ...], kind: str,
             device: str) -> int:
        nbytes = int(flat.numel())
        self.offset = (self.offset + ALIGN - 1) // ALIGN * ALIGN
        self.records.append(TensorRecord(dtype, shape, self.offset, nbytes, kind, device))
        self.sources.append(flat)
        self.offset += nbytes
        return len(self.records) - 1

    def encode(self, obj: Any, where: str) -> Any:
        if _np is not None and isinstance(obj, _np.generic):  # before float: np.float64 is one
            return {TAG: "npscalar", "dtype": obj.dtype.str, "v": self.encode(obj.item(), where)}
        if obj is None or isinstance(obj, bool | str):
            return obj
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            if math.isfinite(obj):
                return obj
            return {TAG: "float", "v": repr(obj)}
        if isinstance(obj, torch.Tensor):
            idx = self._add(_flat_bytes(obj, where), _dtype_name(obj.dtype), tuple(obj.shape),
                            "torch", str(obj.device))
            return {TAG: "tensor", "i": idx}
        if _np is not None and isinstance(obj, _np.ndarray):
            if obj.dtype.hasobject:
                raise CheckpointError(f"cannot checkpoint {where}: numpy object array")
            arr = _np.ascontiguousarray(obj)
            flat = torch.from_numpy(arr.reshape(-1).view(_np.uint8))
            idx = self._add(flat, arr.dtype.str, tuple(arr.shape), "numpy", "cpu")
            return {TAG: "ndarray", "i": idx}
        if isinstance(obj, dict):
            return {TAG: "dict", "items": [
                [self.encode(k, f"{where}[{k!r}]<key>"), self.encode(v, f"{where}[{k!r}]")]
                for k, v in obj.items()]}
        if isinstance(obj, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, torch.Size):
            return {TAG: "size", "v": list(obj)}
        if isinstance(obj, tuple):
            return {TAG: "tuple", "v": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, bytes | bytearray):
            return {TAG: "bytes", "b64": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {TAG: "dtype", "v": _dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {TAG: "device", "v": str(obj)}
        raise CheckpointError(f"cannot checkpoint {where}: unsupported type {type(obj).__name__}")


def encode(tree: Any) -> Encoded:
    """Split `tree` into a JSON-able skeleton and a tensor table (no data is copied here)."""
    enc = _Encoder()
    skeleton = enc.encode(tree, "state")
    return Encoded(skeleton, enc.records, enc.sources, enc.offset)


def view_tensor(record: TensorRecord, raw: torch.Tensor) -> Any:
    """Turn the raw uint8 bytes of `record` into the saved tensor / numpy array (no copy)."""
    if record.kind == "numpy":
        if _np is None:
            raise CheckpointError("checkpoint holds numpy arrays but numpy is not installed")
        return raw.numpy().view(_np.dtype(record.dtype)).reshape(record.shape)
    dtype = torch_dtype(record.dtype)
    return raw.view(dtype).reshape(record.shape)


def decode(skeleton: Any, tensors: list[Any]) -> Any:
    """Rebuild the state tree from its skeleton and the loaded tensors (by table index)."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    tag = skeleton.get(TAG)
    try:
        if tag == "dict":
            return {decode(k, tensors): decode(v, tensors) for k, v in skeleton["items"]}
        if tag in ("tensor", "ndarray"):
            return tensors[int(skeleton["i"])]
        if tag == "tuple":
            return tuple(decode(v, tensors) for v in skeleton["v"])
        if tag == "float":
            return float(skeleton["v"])
        if tag == "size":
            return torch.Size(skeleton["v"])
        if tag == "bytes":
            return base64.b64decode(skeleton["b64"])
        if tag == "dtype":
            return torch_dtype(skeleton["v"])
        if tag == "device":
            return torch.device(skeleton["v"])
        if tag == "npscalar":
            if _np is None:
                raise CheckpointError("checkpoint holds numpy scalars but numpy is not installed")
            return _np.dtype(skeleton["dtype"]).type(decode(skeleton["v"], tensors))
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise CheckpointError(f"malformed state entry {skeleton!r:.80}") from err
    raise CheckpointError(f"unknown state tag {tag!r}")
