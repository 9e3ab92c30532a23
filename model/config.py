"""GLM-5.3-Flash text-model configuration, read from a checkpoint's `config.json`.

Checkpoints come in two spellings: the release one (`deepseek_sparse_attention` layers, a `linear_attn_config`
dict, fields under `text_config`) and the one transformers' `save_pretrained` writes (`indexed_attention`, flat
`linear_*` fields). Both are read here into one frozen dataclass so the rest of the runtime never sees the difference.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KDA = "linear_attention"
MLA = "deepseek_sparse_attention"
# Every spelling of an MLA (+DSA indexer) layer seen in the wild; the release spelling is `MLA`.
_MLA_SPELLINGS = {"deepseek_sparse_attention", "indexed_attention", "full_attention"}


@dataclass(frozen=True)
class Dimensions:
    """GLM-5.3-Flash's sizes and constants, listed once: a checkpoint's `ModelConfig` reads them, make-tiny's
    `TinySpec` writes them (model/checkpoint/spec.py). The defaults are the release's (docs/reference.md §1)."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_routed_experts: int = 288
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 4
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    qk_rope_head_dim: int = 0  # NoPE, as released

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim != 0:
            raise ValueError("GLM-5.3-Flash MLA is NoPE: qk_rope_head_dim must be 0")


# Where transformers' glm5_next class defaults differ from the release: what a config.json without the key means.
_HF_DEFAULTS = {"index_kpool": 16}


@dataclass(frozen=True)
class ModelConfig(Dimensions):
    index_kpool_always_select_tail: bool = True
    pad_token_id: int | None = 154820
    eos_token_id: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    mlp_layer_types: tuple[str, ...] = field(default_factory=tuple)
    indexer_types: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} layers")
        if self.index_topk % self.index_kpool:
            raise ValueError(f"index_topk ({self.index_topk}) must be divisible by index_kpool ({self.index_kpool})")
        for i, (lt, it) in enumerate(zip(self.layer_types, self.indexer_types)):
            if lt == MLA and it == "shared" and self.full_indexer_layer(i) is None:
                raise ValueError(f"layer {i} shares an indexer selection but no earlier MLA layer runs a full indexer")

    # ----- derived facts the runtime asks for -----
    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    @property
    def mtp_layer_index(self) -> int:
        """The MTP block is stored after the last text layer (`layers.{num_hidden_layers}`)."""
        return self.num_hidden_layers

    def full_indexer_layer(self, layer: int) -> int | None:
        """The MLA layer whose indexer selection `layer` uses: itself if full, else the nearest earlier full one."""
        for i in range(layer, -1, -1):
            if self.layer_types[i] == MLA and self.indexer_types[i] == "full":
                return i
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ----- reading -----
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        text = dict(raw.get("text_config") or raw)
        n = int(text.get("num_hidden_layers", cls.num_hidden_layers))
        kw: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name in text and name not in ("layer_types", "mlp_layer_types", "indexer_types", "eos_token_id"):
                kw[name] = text[name]
        for name, value in _HF_DEFAULTS.items():
            kw.setdefault(name, value)
        lin = text.get("linear_attn_config") or {}
        for src, dst in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                         ("short_conv_kernel_size", "linear_conv_kernel_dim"), ("gate_lower_bound", "linear_lower_bound")):
            if src in lin:
                kw[dst] = lin[src]
        if lin and lin.get("safe_gate", True) and kw.get("linear_lower_bound", -5.0) is None:
            kw["linear_lower_bound"] = -5.0

        layer_types = text.get("layer_types") or [KDA if i % 4 != 3 else MLA for i in range(n)]
        kw["layer_types"] = tuple(MLA if t in _MLA_SPELLINGS else t for t in layer_types)
        unknown = set(kw["layer_types"]) - {KDA, MLA}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}")
        kw["mlp_layer_types"] = tuple(text.get("mlp_layer_types") or (["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)))
        kw["indexer_types"] = tuple(_indexer_types(text, n))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        kw["eos_token_id"] = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        return cls(**kw)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        cfg = cls.from_hf_dict(raw)
        gen = Path(model_dir) / "generation_config.json"
        if not cfg.eos_token_id and gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                cfg = cls(**{**cfg.to_dict(), "eos_token_id": tuple(eos if isinstance(eos, list) else [eos])})
        return cfg


def _indexer_types(text: dict[str, Any], n: int) -> list[str]:
    """Per-layer indexer mode, following transformers' precedence: explicit list, then pattern, then freq/offset."""
    if text.get("indexer_types"):
        return list(text["indexer_types"])
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(int(text.get("index_topk_freq", 1)), 1)
    offset = int(text.get("index_skip_topk_offset", 2))
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
