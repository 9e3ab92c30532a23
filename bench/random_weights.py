"""Random weights at the real GLM-5.3-Flash layer dimensions, made directly on the device (no download, no disk).

The key list, shapes and initialisation recipes come from make-tiny (`tiny.weights.all_tensors` over a `TinySpec`
filled with the release's dimensions), so the benchmark model and the tiny checkpoints can never disagree about
which tensors exist. `RandomWeightReader` has the `WeightReader` interface the model loads through; it draws each
requested tensor on the device with a per-key generator and keeps no copy of its own (and none on the CPU).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable

import torch

from services.rank_worker.model.config import ModelConfig
from services.rank_worker.model.model import Glm5Model
from services.rank_worker.model.parallel import Collective, Sharding
from services.rank_worker.model.tiny.config_builder import text_config
from services.rank_worker.model.tiny.spec import TinySpec, default_layer_pattern
from services.rank_worker.model.tiny.tensor_spec import TensorSpec, key_seed
from services.rank_worker.model.tiny.vision_weights import PREFIX as VISION_PREFIX
from services.rank_worker.model.tiny.weights import all_tensors
from services.rank_worker.model.weights import _KEEP_FP32  # the loader's fp32 rule: follow it exactly

# GLM-5.3-Flash text dimensions (REFERENCE.md §1). Layer count and pattern are chosen per run.
REAL_DIMS: dict[str, object] = dict(
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_attention_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    v_head_dim=256,
    n_routed_experts=288,
    num_experts_per_tok=8,
    n_shared_experts=1,
    linear_num_heads=64,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    index_n_heads=32,
    index_head_dim=128,
    index_kpool=4,
    index_topk=2048,
    hc_mult=4,
    vocab_size=154880,
)
REAL_PAD_TOKEN_ID = 154820
TINY_VOCAB = 1088  # make-tiny's vocabulary size (1026 tokens rounded up to 64); the benchmark needs no tokenizer


def bench_spec(*, layers: int = 4, layer_pattern: str | None = None, tiny: bool = False) -> TinySpec:
    """Real dimensions (or make-tiny's defaults with `tiny`), `layers` layers, no MTP block.

    Layer pattern: the release's 3:1 layout by default ("KKKM" for 4 layers). FFNs: the first layer dense, the
    rest MoE (TinySpec's rule), so 4 layers = 3 KDA + 1 MLA/DSA, 1 dense + 3 MoE.
    """
    dims = {} if tiny else dict(REAL_DIMS)
    dims.setdefault("vocab_size", TINY_VOCAB)
    return TinySpec(num_hidden_layers=layers, layer_pattern=layer_pattern or default_layer_pattern(layers),
                    num_nextn_predict_layers=0, **dims)


def bench_config(spec: TinySpec) -> ModelConfig:
    pad = REAL_PAD_TOKEN_ID if REAL_PAD_TOKEN_ID < spec.vocab_size else 0
    return ModelConfig.from_hf_dict(text_config(spec, pad_token_id=pad, eos_token_ids=[pad]))


def text_tensors(spec: TinySpec) -> list[TensorSpec]:
    """Every tensor a text forward can read (no vision tower; the spec has no MTP block)."""
    return [t for t in all_tensors(spec) if not t.key.startswith(VISION_PREFIX)]


def spec_dims(spec: TinySpec) -> dict[str, object]:
    """The spec as plain JSON-able values (for the results file)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()
            if not k.startswith("vision_")}


def keeps_fp32(key: str) -> bool:
    return any(m in key for m in _KEEP_FP32)


def draw(t: TensorSpec, *, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`tiny.tensor_spec.materialize`'s recipes, drawn on `device` (values differ from the CPU draw; only the
    distribution matters here)."""
    g = torch.Generator(device=device).manual_seed(key_seed(seed, t.key))
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


class RandomWeightReader:
    """`WeightReader`'s interface (dtype, device, sharding, full, split, has, close) over random tensors."""

    def __init__(self, spec: TinySpec, sharding: Sharding, dtype: torch.dtype, device: torch.device | str, *,
                 seed: int = 0, log: Callable[[str], None] | None = None, log_every_bytes: int = 4 << 30) -> None:
        self.spec = spec
        self.sharding = sharding
        self.dtype = dtype
        self.device = torch.device(device)
        self.seed = seed
        self.tensors = {t.key: t for t in text_tensors(spec)}
        self.bytes_made = 0
        self.tensors_made = 0
        self._log = log
        self._log_every = log_every_bytes
        self._next_log = log_every_bytes
        self._t0 = time.perf_counter()

    def has(self, key: str) -> bool:
        return key in self.tensors

    def _make(self, key: str) -> torch.Tensor:
        if key not in self.tensors:
            raise KeyError(f"random benchmark model has no tensor {key}")
        t = draw(self.tensors[key], seed=self.seed, dtype=self.dtype, device=self.device)
        self.bytes_made += t.numel() * t.element_size()
        self.tensors_made += 1
        if self._log and self.bytes_made >= self._next_log:
            self._next_log += self._log_every
            self._log(f"  weights: {self.bytes_made / 2**30:.1f} GiB drawn ({self.tensors_made} tensors, "
                      f"{time.perf_counter() - self._t0:.1f} s)")
        return t

    def full(self, key: str) -> torch.Tensor:
        return self._make(key)

    def split(self, key: str, dim: int) -> list[torch.Tensor]:
        t = self._make(key)
        parts = self.sharding.split(t.shape[dim], key)
        if len(parts) == 1 and parts[0] == slice(0, t.shape[dim]):
            return [t]
        return [(t[s] if dim == 0 else t[:, s]).contiguous() for s in parts]

    def close(self) -> None:
        pass


def build_model(spec: TinySpec, *, device: torch.device | str, dtype: torch.dtype, seed: int = 0, virtual: int = 1,
                log: Callable[[str], None] | None = None) -> tuple[Glm5Model, RandomWeightReader]:
    """A one-rank `Glm5Model` over random weights (no MTP). `virtual=1`: one product per weight, for speed."""
    sharding = Sharding(virtual=virtual)
    reader = RandomWeightReader(spec, sharding, dtype, device, seed=seed, log=log)
    quiet = {"progress": False} if "progress" in inspect.signature(Glm5Model.__init__).parameters else {}
    model = Glm5Model(bench_config(spec), reader, Collective(sharding), load_mtp=False, **quiet)
    reader.close()
    return model, reader
