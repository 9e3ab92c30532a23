"""One tensor of the checkpoint, described before it exists: its key, shape and how to initialise it.

Listing every tensor first (rather than building a model) keeps make-tiny free of transformers and lets the writer
size the shards before drawing a single random number.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

# Tensors the release keeps in float32 whatever the checkpoint dtype (transformers' `_keep_in_fp32_modules_strict`):
# they feed exp/softplus/sigmoid gates or the router's bias, where bf16 rounding visibly changes results.
_FP32_SUFFIXES = ("e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log")
_FP32_HC = ("_base", "_scale")


def keeps_fp32(key: str) -> bool:
    name = key.rsplit(".", 1)[-1]
    if key.endswith(_FP32_SUFFIXES):
        return True
    return name.startswith("hc_") and name.endswith(_FP32_HC)


@dataclass(frozen=True)
class Init:
    """How to draw a tensor: `kind` picks the recipe, `a`/`b` are its parameters."""

    kind: str  # normal | abs_normal | one_plus | uniform | dt_bias
    a: float = 0.0
    b: float = 0.0


def normal(std: float) -> Init:
    return Init("normal", std)


def fan_in(n: int) -> Init:
    """Linear weights: unit-variance outputs for unit-variance inputs, so activations stay O(1) through the stack."""
    return Init("normal", 1.0 / math.sqrt(n))


NORM = Init("one_plus", 0.1)  # norm gains near 1, but not exactly, so a dropped gain shows up in parity tests
BIAS = Init("normal", 0.1)


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    init: Init

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if keeps_fp32(self.key) else dtype

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.numel * torch.empty((), dtype=self.storage_dtype(dtype)).element_size()


def key_seed(seed: int, key: str) -> int:
    """A generator seed per (seed, key): a tensor's values never depend on which other tensors exist or their order."""
    digest = hashlib.sha256(f"twinspark-tiny/{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def materialize(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Draw the tensor in float32 (so values match across --dtype up to rounding) and cast to its storage dtype."""
    g = torch.Generator().manual_seed(key_seed(seed, spec.key))
    init = spec.init
    if init.kind == "normal":
        t = torch.randn(spec.shape, generator=g) * init.a
    elif init.kind == "abs_normal":
        t = torch.randn(spec.shape, generator=g).abs() * init.a
    elif init.kind == "one_plus":
        t = 1.0 + torch.randn(spec.shape, generator=g) * init.a
    elif init.kind == "uniform":
        t = torch.rand(spec.shape, generator=g) * (init.b - init.a) + init.a
    elif init.kind == "dt_bias":
        # FLA / HF init: dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt) so softplus(dt_bias) == dt.
        log_dt = torch.rand(spec.shape, generator=g) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)
        dt = log_dt.exp().clamp_min(1e-4)
        t = dt + torch.log(-torch.expm1(-dt))
    else:
        raise ValueError(f"unknown init kind {init.kind!r} for {spec.key}")
    return t.to(spec.storage_dtype(dtype)).contiguous()
