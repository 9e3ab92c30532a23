"""The shape of a tiny GLM-5.3-Flash: every dimension and per-layer schedule `make-tiny` writes.

One frozen dataclass so the config writer and the weight generator can never disagree about a size; the model's own
fields are model.config.Dimensions', listed once there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.config import KDA, MLA, Dimensions

TP_MAX = 4  # the widest tensor-parallel split the tiny model must still divide evenly into


def default_layer_pattern(layers: int) -> str:
    """The release's 3:1 layout: every 4th layer (i % 4 == 3) is MLA+DSA, the rest KDA."""
    return "".join("M" if i % 4 == 3 else "K" for i in range(layers))


# The tiny model's sizes: the release's (model.config.Dimensions) shrunk until a forward pass takes milliseconds on a
# CPU, every head count and intermediate size still divisible by TP_MAX.
TINY: dict[str, object] = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8, num_attention_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    linear_num_heads=4, linear_head_dim=16,
    index_n_heads=16,  # many heads make an all-ReLU-zero (tied) pool score rare: 2^-16 per pool
    index_head_dim=16, index_topk=64, vocab_size=0)  # vocab: derived from the tokenizer at build time


@dataclass(frozen=True)
class TinySpec(Dimensions):
    """A checkpoint to write: the model's dimensions (the release's unless given; `TinySpec.tiny` starts from the tiny
    model's) and what only the writer needs."""

    dense_layers: int = 1  # leading layers with a dense FFN (the release: 3); the rest are MoE
    # std of the embedding rows; larger = a calmer model (each block's update small beside the residual, presets.py)
    embed_std: float = 1.0
    layer_pattern: str = ""  # K/M per layer; empty = the release's 3:1 layout
    indexer_pattern: str = ""  # F/S per layer; empty = all full
    # vision tower (transformers always builds one, so the checkpoint must carry its weights)
    vision_depth: int = 1
    vision_hidden_size: int = 32
    vision_num_heads: int = 2
    vision_intermediate_size: int = 64
    vision_projection_intermediate_size: int = 64
    vision_patch_size: int = 14
    vision_image_size: int = 28
    vision_spatial_merge_size: int = 2
    vision_temporal_patch_size: int = 2
    vision_in_channels: int = 3
    layer_types: tuple[str, ...] = field(init=False)
    indexer_types: tuple[str, ...] = field(init=False)
    mlp_layer_types: tuple[str, ...] = field(init=False)

    @classmethod
    def tiny(cls, **overrides: object) -> "TinySpec":
        """The tiny model (make-tiny's default), with `overrides`."""
        return cls(**{**TINY, **overrides})

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_hidden_layers
        if n < 1:
            raise ValueError(f"need at least 1 layer, got {n}")
        lp = (self.layer_pattern or default_layer_pattern(n)).upper()
        ip = (self.indexer_pattern or "F" * n).upper()
        for name, pat, ok in (("layer pattern", lp, "KM"), ("indexer pattern", ip, "FS")):
            if len(pat) != n:
                raise ValueError(f"{name} {pat!r} has {len(pat)} letters for {n} layers")
            if set(pat) - set(ok):
                raise ValueError(f"{name} {pat!r} may only use the letters {'/'.join(ok)}")
        layer_types = tuple(MLA if c == "M" else KDA for c in lp)
        indexer_types = tuple("full" if c == "F" else "shared" for c in ip)
        # A shared layer reuses the nearest earlier full MLA layer's selection, so one must exist.
        seen_full = False
        for i, (lt, it) in enumerate(zip(layer_types, indexer_types)):
            if lt == MLA and it == "full":
                seen_full = True
            elif lt == MLA and not seen_full:
                raise ValueError(f"layer {i} shares an indexer selection but no earlier MLA layer runs a full indexer")
        object.__setattr__(self, "layer_pattern", lp)
        object.__setattr__(self, "indexer_pattern", ip)
        object.__setattr__(self, "layer_types", layer_types)
        object.__setattr__(self, "indexer_types", indexer_types)
        # By default only the first layer is dense: the tiny model then has MoE on every later layer, the path most
        # code takes.
        object.__setattr__(self, "mlp_layer_types", tuple("dense" if i < self.dense_layers else "sparse"
                                                          for i in range(n)))

        if self.index_topk < 1 or self.index_topk % self.index_kpool:
            raise ValueError(
                f"index_topk ({self.index_topk}) must be a positive multiple of index_kpool ({self.index_kpool})")
        if self.n_routed_experts < self.num_experts_per_tok:
            raise ValueError(f"need at least {self.num_experts_per_tok} experts, got {self.n_routed_experts}")
        for name in ("num_attention_heads", "linear_num_heads", "index_n_heads", "intermediate_size",
                     "moe_intermediate_size", "hidden_size"):
            if getattr(self, name) % TP_MAX:
                raise ValueError(f"{name} ({getattr(self, name)}) must be divisible by {TP_MAX} for tensor parallelism")

    @property
    def mtp_layer_index(self) -> int:
        """The MTP block is stored after the last text layer, as in the release (`layers.45` there)."""
        return self.num_hidden_layers
