"""Random weights drawn on the device instead of read from shards: the whole model at real dimensions with no
checkpoint on disk (`serve-rank --random-weights`, the benchmarks), dense or quantized.

The key list, shapes and initialisation recipes come from make-tiny (`tiny.weights.all_tensors` over a `TinySpec`),
so the random model and the tiny checkpoints never disagree about which tensors exist. `RandomWeightReader` has the
`WeightReader` interface the model loads through; it draws each requested tensor on the device with a per-key
generator and keeps no copy of its own (and none on the CPU). With a quantize `Recipe`, the linears the recipe
selects are drawn directly in their packed form (random fp8 values / int4 nibbles / int codes / trellis words +
scales), never as a dense copy; the dense views (`full` / `split`) dequantize them, the packed views return them as
they are. The recipe is planned for the reader's virtual shards (a linear is packed only if each shard is whole
tiles), EXL3 linears get the rates quantize/bits.py spreads the recipe's target bitrate over (`exl3:3.0+fp8`), and
int linears their format's width (`int3+int4`: 3-bit experts, 4-bit rest). An int linear's (w4a16's too) scales
get random signs (`sign_scales`): without them every such linear favours one input direction and the random model
answers every prompt with one token repeated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Union

import torch

from kernels.quant import QuantizedWeight, random_quantized
from model.config import MLA, ModelConfig
from model.parallel import Sharding
from model.quantize import bits as exl3_bits
from model.quantize.select import Recipe, codec_format
from model.checkpoint.spec import TinySpec
from model.checkpoint.tensor_spec import TensorSpec, key_seed
from model.checkpoint.vision_weights import PREFIX as VISION_PREFIX
from model.checkpoint.weights import all_tensors
from model.weights import _KEEP_FP32  # the loader's fp32 rule: follow it exactly

Packed = Union[torch.Tensor, QuantizedWeight]

# The int codecs' random draw (kernels/quant/intn.py; w4a16 draws through it) takes codes uniform over
# [-2^(b-1), 2^(b-1) - 1], whose mean is half a step below zero, and every scale positive: each linear is then a
# zero-mean random matrix plus c * std * 1 1^T, c = -0.5 / the codes' std (-0.11 at 4 bits, -0.22 at 3, -0.45 at 2),
# which multiplies the all-ones input direction by about |c| sqrt(in) and maps it onto the all-ones output, where the
# next linear multiplies it again. At the release's widths that is several times per linear (the tiny model's 64
# keep it under 1, so the tiny tests never saw it): layer after layer the residual becomes that one direction, the
# final norm's output stops depending on the input and every greedy reply is one token repeated. Before and after:
# docs/benchmarks.md, "Random weights that speak (CPU)".
SIGNED_SCALE_CODECS = ("int", "w4a16")


def spec_from_config(cfg: ModelConfig) -> TinySpec:
    """The TinySpec that lists exactly the tensors a model of `cfg` loads (its dims, layer and FFN schedule)."""
    n = cfg.num_hidden_layers
    dense = next((i for i, t in enumerate(cfg.mlp_layer_types) if t != "dense"), n)
    if any(t != "sparse" for t in cfg.mlp_layer_types[dense:]):
        raise ValueError(f"random weights need the dense FFN layers first, got {cfg.mlp_layer_types}")
    names = {f.name for f in dataclasses.fields(TinySpec) if f.init}
    kw = {k: v for k, v in cfg.to_dict().items() if k in names and v is not None}
    kw.update(dense_layers=dense, layer_pattern="".join("M" if t == MLA else "K" for t in cfg.layer_types),
              indexer_pattern="".join("F" if t == "full" else "S" for t in cfg.indexer_types))
    return TinySpec(**kw)


def text_tensors(spec: TinySpec) -> list[TensorSpec]:
    """Every tensor a text forward can read (no vision tower)."""
    return [t for t in all_tensors(spec) if not t.key.startswith(VISION_PREFIX)]


def keeps_fp32(key: str) -> bool:
    return any(m in key for m in _KEEP_FP32)


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator for draws on `device`. The meta device has none of its own (and draws nothing: shapes
    only, bench/kernel_census.py lays the model out on it), so it takes a CPU one, which meta draws accept."""
    return torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)


def draw(t: TensorSpec, *, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`tiny.tensor_spec.materialize`'s recipes, drawn on `device` (values differ from the CPU draw; only the
    distribution matters here)."""
    g = generator(torch.device(device), key_seed(seed, t.key))
    init = t.init
    kw = dict(generator=g, device=device, dtype=torch.float32)
    if init.kind == "normal":
        x = torch.randn(t.shape, **kw).mul_(init.a)
    elif init.kind == "abs_normal":
        x = torch.randn(t.shape, **kw).abs_().mul_(init.a)
    elif init.kind == "one_plus":
        x = torch.randn(t.shape, **kw).mul_(init.a).add_(1.0)
    elif init.kind == "uniform":
        x = torch.rand(t.shape, **kw).mul_(init.b - init.a).add_(init.a)
    elif init.kind == "dt_bias":
        # dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt) (as make-tiny and FLA do)
        log_dt = torch.rand(t.shape, **kw) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)
        dt = log_dt.exp().clamp_min(1e-4)
        x = dt + torch.log(-torch.expm1(-dt))
    else:
        raise ValueError(f"unknown init kind {init.kind!r} for {t.key}")
    out = x.to(torch.float32 if keeps_fp32(t.key) else dtype)
    return out if out.is_contiguous() else out.contiguous()


def sign_scales(w: QuantizedWeight, g: torch.Generator) -> QuantizedWeight:
    """`w` with a random sign (from `g`) on each of its int scales, in place; other formats as they are.

    The int format's scales are signed anyway (a group's scale takes the sign that puts its largest element on the
    bottom level, so quantizing a zero-mean weight gives each sign half the time), and a random sign per group
    turns the codes' mean offset from one direction every linear amplifies into a different random pattern per
    linear, which no chain of linears lines up."""
    if w.format not in SIGNED_SCALE_CODECS:
        return w
    scale = w.tensors["weight_scale"]
    signs = torch.randint(0, 2, scale.shape, generator=g, device=scale.device, dtype=torch.int8)
    scale.mul_(signs.mul_(2).sub_(1).to(scale.dtype))
    return w


class RandomWeightReader:
    """`WeightReader`'s interface (dtype, device, sharding, full, split, full_packed, split_packed, has, close) over
    random tensors; `recipe` picks the linears drawn quantized (None: everything dense)."""

    def __init__(self, spec: TinySpec, sharding: Sharding, dtype: torch.dtype, device: torch.device | str, *,
                 seed: int = 0, recipe: Recipe | None = None, log: Callable[[str], None] | None = None,
                 log_every_bytes: int = 4 << 30) -> None:
        self.spec = spec
        self.sharding = sharding
        self.dtype = dtype
        self.device = torch.device(device)
        self.seed = seed
        self.recipe = None if recipe is None else dataclasses.replace(recipe, virtual=sharding.virtual)
        self.tensors = {t.key: t for t in text_tensors(spec)}
        exl3 = {k: t.numel for k, t in self.tensors.items() if self.format_of(k) == "exl3"}
        r = self.recipe
        self.exl3_plan = exl3_bits.plan(exl3, r.exl3_bits, r.exl3_codebook) if r is not None and exl3 else None
        self.bytes_made = 0
        self.stored_bytes: dict[str, int] = {}  # per key, its bytes as drawn (packed or dense): what a step reads
        self.tensors_made = 0
        self.quantized_made = 0
        self._log = log
        self._log_every = log_every_bytes
        self._next_log = log_every_bytes
        self._t0 = time.perf_counter()

    def has(self, key: str) -> bool:
        return key in self.tensors

    def format_of(self, key: str) -> str | None:
        """The format `key` is drawn in (None: dense)."""
        t = self.tensors[key]
        if self.recipe is None or t.init.kind != "normal":
            return None
        return self.recipe.format_for(key, t.shape)

    def _make(self, key: str) -> Packed:
        if key not in self.tensors:
            raise KeyError(f"random model has no tensor {key}")
        t, fmt = self.tensors[key], self.format_of(key)
        if fmt is None:
            made: Packed = draw(t, seed=self.seed, dtype=self.dtype, device=self.device)
            size = made.numel() * made.element_size()
        else:
            r = self.recipe
            g = generator(self.device, key_seed(self.seed, key))
            codec, bits = codec_format(fmt)
            made = random_quantized(codec, *t.shape, std=t.init.a, block=r.block_for(fmt),
                                    bits=self.exl3_plan.bits[key] if codec == "exl3" else bits,
                                    codebook=r.exl3_codebook, generator=g, device=self.device)
            made = sign_scales(made, g)  # the same generator, after the draw: deterministic from the seed
            size = made.nbytes
            self.quantized_made += 1
        self.bytes_made += size
        self.stored_bytes[key] = size
        self.tensors_made += 1
        if self._log and self.bytes_made >= self._next_log:
            self._next_log += self._log_every
            self._log(f"  weights: {self.bytes_made / 2**30:.1f} GiB drawn ({self.tensors_made} tensors, "
                      f"{time.perf_counter() - self._t0:.1f} s)")
        return made

    def _parts(self, key: str, dim: int) -> list[Packed]:
        t = self._make(key)
        size = t.shape[dim]
        parts = self.sharding.split(size, key)
        if len(parts) == 1 and parts[0] == slice(0, size):
            return [t]
        if isinstance(t, QuantizedWeight):
            return [t.cut(dim, s, key) for s in parts]
        return [(t[s] if dim == 0 else t[:, s]).contiguous() for s in parts]

    def _dense(self, t: Packed) -> torch.Tensor:
        return t.dequantize(self.dtype) if isinstance(t, QuantizedWeight) else t

    def full(self, key: str) -> torch.Tensor:
        return self._dense(self._make(key))

    def split(self, key: str, dim: int) -> list[torch.Tensor]:
        return [self._dense(t) for t in self._parts(key, dim)]

    def full_packed(self, key: str) -> Packed:
        return self._make(key)

    def split_packed(self, key: str, dim: int) -> list[Packed]:
        return self._parts(key, dim)

    def close(self) -> None:
        pass
