"""Reading a rank's weights from an HF safetensors checkpoint (single file or sharded with an index), dense or
quantized.

Only the slices this rank owns are read (safetensors' lazy slicing). A linear `X.weight` may be stored dense or in
a quantized format (kernels/quant: fp8, w4a16, int, exl3), recognised per module from its stored tensor names (and,
where two formats share the names, w4a16's and int's, from their scales' dtype), so a checkpoint can mix formats and
keep some modules in bf16 (e.g. EXL3 experts + bf16 attention). Two views:
- `full(key)` / `split(key, dim)`: dense tensors in the runtime dtype; a quantized linear is dequantized at load by
  its torch reference (the CPU path: the model code does not change with the format).
- `full_packed(key)` / `split_packed(key, dim)`: `QuantizedWeight`s for quantized linears (dense tensors for the
  rest), for kernels that compute on the stored format.
A quantized shard is cut from the stored tensors on its format's tile grid (fp8 blocks, w4a16 / int groups, EXL3's
128-wide Hadamard blocks); a split off that grid is refused with an error naming the tile size.

Parameters that the reference model keeps in fp32 (router bias, KDA decay parameters, conv weights, mHC base and
scale) stay fp32 whatever the runtime dtype. exllamav3 writes KDA's q/k/v projections (and their short convs) fused
as `qkv_proj` / `conv1d`; those are read as row thirds of the fused tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch
from safetensors import safe_open
from tqdm import tqdm

from kernels.quant import QuantizedWeight, quantized_modules
from kernels.quant.codec import Codec
from model.parallel import Sharding
from model.quant_config import read_quant_configs

_KEEP_FP32 = ("e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log", "_base", "_scale")
TEXT_PREFIX = "model.language_model."
# exllamav3's fused KDA tensors: (our name's ending, the fused tensor's ending, which third of its rows).
_FUSED = tuple((f"self_attn.{p}{what}.weight", f"self_attn.{fused}.weight", i)
               for what, fused in (("_proj", "qkv_proj"), ("_conv1d", "conv1d")) for i, p in enumerate("qkv"))

Packed = Union[torch.Tensor, QuantizedWeight]
# safetensors' names of the dtypes in its headers
_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def header_dtype(header) -> torch.dtype:
    """A stored tensor's dtype from its safetensors header (`handle.get_slice(key)`: nothing read)."""
    return _HEADER_DTYPES[header.get_dtype()]


@dataclass(frozen=True)
class _Stored:
    """Where a requested tensor lives: a stored dense tensor, or a quantized module (codec set), possibly as a row
    window of a fused tensor."""

    key: str  # the stored tensor key (dense) or module key (quantized)
    codec: Codec | None
    rows: slice | None = None


class WeightReader:
    def __init__(self, model_dir: str | Path, sharding: Sharding, dtype: torch.dtype, device: torch.device,
                 progress: bool = True) -> None:
        self.dir = Path(model_dir)
        self.sharding = sharding
        self.dtype = dtype
        self.device = device
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = dict(json.loads(index.read_text())["weight_map"])
        else:
            single = self.dir / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(f"no model.safetensors(.index.json) in {self.dir}")
            with safe_open(single, "pt") as f:
                self.files = {k: single.name for k in f.keys()}
        self.quant_configs = read_quant_configs(self.dir)
        self._handles: dict[str, object] = {}
        modules = quantized_modules(self.files, lambda k: header_dtype(self._handle(k).get_slice(k)))
        self.quantized = {m: c for m, (c, _) in modules.items()}  # module -> its format
        self._module_keys = {m: names for m, (_, names) in modules.items()}  # module -> {tensor name: stored key}
        # One progress step per logical tensor (a quantized linear's stored tensors count once); no vision tower.
        logical = {k for k in self.files if k.rpartition(".")[0] not in self.quantized} | set(self.quantized)
        self._bar = tqdm(total=sum(1 for k in logical if not k.startswith("model.visual.")),
                         desc=f"loading weights (rank {sharding.rank})", unit="tensor", disable=not progress)

    # ----- where a tensor is -----
    def _spellings(self, key: str) -> tuple[str, ...]:
        """Text-only checkpoints name text weights `model.layers.*` instead of `model.language_model.layers.*`."""
        return (key, "model." + key[len(TEXT_PREFIX):]) if key.startswith(TEXT_PREFIX) else (key,)

    def _direct(self, key: str) -> _Stored | None:
        for k in self._spellings(key):
            module = k.removesuffix(".weight")
            if k.endswith(".weight") and module in self.quantized:
                return _Stored(module, self.quantized[module])
            if k in self.files:
                return _Stored(k, None)
        return None

    def _locate(self, key: str) -> _Stored:
        found = self._direct(key)
        if found is not None:
            return found
        for ours, fused, third in _FUSED:
            if key.endswith(ours) and (whole := self._direct(key.removesuffix(ours) + fused)) is not None:
                rows = self._shape(whole)[0] // 3
                return _Stored(whole.key, whole.codec, slice(third * rows, (third + 1) * rows))
        raise KeyError(f"checkpoint {self.dir} has no tensor {key}")

    def has(self, key: str) -> bool:
        try:
            self._locate(key)
        except KeyError:
            return False
        return True

    def is_quantized(self, key: str) -> bool:
        return self._locate(key).codec is not None

    # ----- reading -----
    def _handle(self, stored_key: str):
        name = self.files[stored_key]
        if name not in self._handles:
            self._handles[name] = safe_open(self.dir / name, "pt")
        return self._handles[name]

    def _qparams(self, s: _Stored, shapes: dict[str, tuple[int, ...]]) -> dict:
        try:
            return s.codec.params(self.quant_configs.get(s.codec.quant_method), shapes)
        except ValueError as e:
            raise ValueError(f"{self.dir}: {s.key}: {e}") from None

    def _stored_shapes(self, s: _Stored) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self._handle(k).get_slice(k).get_shape()) for n, k in self._module_keys[s.key].items()}

    def _shape(self, s: _Stored) -> tuple[int, ...]:
        """The logical shape: a quantized module's dense [out, in]; a fused third's own rows."""
        if s.codec is None:
            shape = tuple(self._handle(s.key).get_slice(s.key).get_shape())
        else:
            shapes = self._stored_shapes(s)
            shape = s.codec.logical_shape(shapes, self._qparams(s, shapes))
        return shape if s.rows is None else (s.rows.stop - s.rows.start, *shape[1:])

    def _read_quantized(self, s: _Stored, dim: int = 0, part: slice | None = None) -> QuantizedWeight:
        """The module's stored tensors, only those covering logical rows / columns `part` of `dim`."""
        keys = self._module_keys[s.key]
        shapes = self._stored_shapes(s)
        params = self._qparams(s, shapes)
        shape = s.codec.logical_shape(shapes, params)
        if part is None:
            part = slice(0, shape[dim])
        s.codec.check_cut(dim, part, shape[dim], params, s.key)
        tensors = {}
        for name, k in keys.items():
            index = s.codec.cut(name, dim, part, params)
            tensors[name] = self._handle(k).get_tensor(k) if index is None else self._handle(k).get_slice(k)[index]
        cut = list(shape)
        cut[dim] = part.stop - part.start
        return QuantizedWeight(s.codec.name, tensors, (cut[0], cut[1]), params)

    def _read(self, s: _Stored, dim: int, part: slice | None) -> Packed:
        """The stored form of logical rows / columns `part` (None: all) of a located tensor."""
        if s.rows is not None:  # a third of a fused tensor: its rows first, then the requested part
            window = self._read_window(s)
            return window if part is None else _cut_loaded(window, dim, part, s.key)
        if s.codec is not None:
            return self._read_quantized(s, dim, part)
        sl = self._handle(s.key).get_slice(s.key)
        return sl[:] if part is None else sl[(part,) if dim == 0 else (slice(None), part)]

    def _read_window(self, s: _Stored) -> Packed:
        if s.codec is not None:
            return self._read_quantized(s, 0, s.rows)
        return self._handle(s.key).get_slice(s.key)[s.rows]

    def _packed(self, key: str, t: Packed) -> Packed:
        if isinstance(t, QuantizedWeight):
            return t.to(self.device)
        dtype = torch.float32 if any(m in key for m in _KEEP_FP32) else self.dtype
        return t.to(device=self.device, dtype=dtype).contiguous()

    def _dense(self, key: str, t: Packed) -> torch.Tensor:
        if isinstance(t, QuantizedWeight):
            return t.dequantize(self.dtype).to(self.device)
        return self._packed(key, t)

    def _parts(self, key: str, dim: int) -> list[Packed]:
        s = self._locate(key)
        parts = [self._read(s, dim, part) for part in self.sharding.split(self._shape(s)[dim], key)]
        self._bar.update(1)
        return parts

    def full(self, key: str) -> torch.Tensor:
        """A replicated tensor, dense."""
        t = self._read(self._locate(key), 0, None)
        self._bar.update(1)
        return self._dense(key, t)

    def split(self, key: str, dim: int) -> list[torch.Tensor]:
        """This rank's virtual-shard slices of `key` along `dim` (0 = output rows, 1 = input columns), dense."""
        return [self._dense(key, t) for t in self._parts(key, dim)]

    def full_packed(self, key: str) -> Packed:
        """A replicated tensor in its stored form: a `QuantizedWeight` if quantized, else as `full`."""
        t = self._read(self._locate(key), 0, None)
        self._bar.update(1)
        return self._packed(key, t)

    def split_packed(self, key: str, dim: int) -> list[Packed]:
        """As `split`, each slice in its stored form."""
        return [self._packed(key, t) for t in self._parts(key, dim)]

    def close(self) -> None:
        self._bar.close()
        self._handles.clear()


def _cut_loaded(t: Packed, dim: int, part: slice, what: str) -> Packed:
    if isinstance(t, QuantizedWeight):
        return t.cut(dim, part, what)
    return t[part] if dim == 0 else t[:, part]
