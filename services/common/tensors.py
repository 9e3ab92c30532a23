"""torch tensors <-> `twinspark.v1.Tensor` (packed little-endian bytes with dtype and shape)."""

from __future__ import annotations

import math

import numpy as np
import torch

from twinspark.v1.tensor_pb2 import Tensor

_TORCH = {"int32": torch.int32, "int64": torch.int64, "float32": torch.float32, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in _TORCH.items()}
# numpy's dtype of each as the bytes travel (little-endian; numpy has no bfloat16: its bits go as int16)
_WIRE = {"int32": "<i4", "int64": "<i8", "float32": "<f4", "bfloat16": "<i2"}


def to_proto(t: torch.Tensor | list[int], dtype: str | None = None) -> Tensor:
    """Pack a tensor (or a list of ints, as int32 unless `dtype` says otherwise)."""
    if not isinstance(t, torch.Tensor):
        name = dtype or "int32"
        if name != "bfloat16":  # most of a round's fields are short lists: numpy packs them ~4x faster than torch
            arr = np.asarray(t, dtype=_WIRE[name])
            return Tensor(dtype=name, shape=list(arr.shape), data=arr.tobytes())
        t = torch.tensor(t, dtype=_TORCH[name])
    elif dtype is not None:
        t = t.to(_TORCH[dtype])
    t = t.detach().cpu().contiguous()
    name = _NAMES.get(t.dtype)
    if name is None:
        raise TypeError(f"cannot send dtype {t.dtype}")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16: ship its bits
    data = raw.numpy().astype(raw.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
    return Tensor(dtype=name, shape=list(t.shape), data=data)


def _array(msg: Tensor) -> np.ndarray:
    """The message's bytes as a numpy array of its shape (wire dtype); ValueError when they do not match."""
    if msg.dtype not in _WIRE:
        raise ValueError(f"unknown tensor dtype {msg.dtype!r}")
    np_dtype = _WIRE[msg.dtype]
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    count = math.prod(shape)  # Python ints: a hostile shape cannot wrap around to match the bytes
    if len(msg.data) != count * np.dtype(np_dtype).itemsize:
        raise ValueError(f"{len(msg.data)} bytes do not hold {msg.dtype}{list(shape)}")
    return np.frombuffer(msg.data, dtype=np_dtype).reshape(shape)


def from_proto(msg: Tensor) -> torch.Tensor:
    """Unpack; raises ValueError when the bytes do not match dtype and shape (a corrupt or hostile message)."""
    arr = _array(msg)
    t = torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))
    return t.view(torch.bfloat16) if msg.dtype == "bfloat16" else t


def ids(msg: Tensor) -> list[int]:
    """A 1-d integer tensor as a Python list (read with numpy alone: every round's sampled ids come this way)."""
    if msg.dtype not in ("int32", "int64") or len(msg.shape) != 1:
        raise ValueError(f"expected a 1-d integer tensor, got {msg.dtype}{list(msg.shape)}")
    return _array(msg).tolist()
