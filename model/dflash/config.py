"""The DFlash2 drafter's configuration, read from a checkpoint's config.json in the published spellings.

A DFlash2 config.json is a Qwen3 config (`model_type` qwen3, architectures `DFlash2DraftModel`) plus the drafter's
own fields, which the reference (z-lab's `dflash` package, `dflash/model.py`) reads from `dflash_config` first and
from the top level second. The defaults below are the ones the reference gets through transformers' `Qwen3Config`,
so a config that leaves a field out means the same thing here as there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLIDING_LAYER = "sliding_attention"
FULL_LAYER = "full_attention"

# Fields of the Qwen3 part that have no sensible default: a config without them is not a drafter's.
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "vocab_size")
# Drafter fields whose absence would make the architecture ambiguous (the reference fails on them too).
_REQUIRED_DRAFT = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's choice when a config names no target layers: spread evenly over layers 1 .. L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    """Every size and switch of a DFlash2 drafter. `hidden_size` and `vocab_size` are the target's: the drafter
    embeds its block with the target's embedding and scores it with the target's lm_head."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    attention_bias: bool
    rope_theta: float
    layer_types: tuple[str, ...]
    sliding_window: int | None  # None: no layer is windowed, whatever layer_types says (Qwen3Config's rule)
    is_causal: bool | None  # None: the reference's default, sliding layers causal and full layers not
    num_target_layers: int
    target_layer_ids: tuple[int, ...]  # target layer outputs read, in this order (hidden_states[i + 1])
    block_size: int
    mask_token_id: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    output_multiplier: float
    final_logit_softcapping: float | None
    input_embedding_scale: float

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if set(self.layer_types) - {SLIDING_LAYER, FULL_LAYER}:
            raise ValueError(f"layer_types may only hold {SLIDING_LAYER!r} / {FULL_LAYER!r}, "
                             f"got {list(self.layer_types)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of conv_group_size "
                             f"({self.conv_group_size})")
        if not 0 < self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k ({self.selector_top_k}) must be in 1..vocab_size ({self.vocab_size})")
        if bad := [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]:
            raise ValueError(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")

    @property
    def conv_groups(self) -> int:
        """Channel groups of the dynamic convolutions: each group shares one predicted kernel."""
        return self.hidden_size // self.conv_group_size

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` in positions, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_LAYER else None

    def causal(self, layer: int) -> bool:
        """Whether `layer`'s block rows see only earlier rows. The reference makes windowed layers causal unless the
        config says `is_causal`; full layers then see the whole block."""
        return self.layer_types[layer] == SLIDING_LAYER if self.is_causal is None else self.is_causal

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DFlashConfig":
        """Read a config.json's contents (published spellings)."""
        missing = [k for k in _REQUIRED if k not in cfg]
        draft: dict[str, Any] = cfg.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            # The reference's lookup order: dflash_config, then the top level, then the default.
            return draft.get(name, cfg.get(name, default))

        missing += [k for k in _REQUIRED_DRAFT if value(k) is None]
        if missing:
            raise ValueError(f"DFlash2 config lacks {', '.join(missing)}")
        layers = int(cfg["num_hidden_layers"])
        # Qwen3Config drops the window unless use_sliding_window is set, and derives layer_types from it.
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        first_windowed = cfg.get("max_window_layers", 28)
        layer_types = cfg.get("layer_types") or [
            SLIDING_LAYER if window is not None and i >= first_windowed else FULL_LAYER for i in range(layers)]
        num_target_layers = value("num_target_layers")
        target_ids = value("target_layer_ids")
        if target_ids is None:
            if num_target_layers is None:
                raise ValueError("DFlash2 config names neither target_layer_ids nor num_target_layers")
            target_ids = default_target_layer_ids(int(num_target_layers), layers)
        mask_token_id = value("mask_token_id")
        if mask_token_id is None:
            raise ValueError("DFlash2 config lacks mask_token_id")
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers, num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]), head_dim=int(cfg.get("head_dim", 128)),
            vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias", False)), rope_theta=_rope_theta(cfg),
            layer_types=tuple(layer_types), sliding_window=None if window is None else int(window),
            is_causal=None if cfg.get("is_causal") is None else bool(cfg["is_causal"]),
            # Without num_target_layers the ids are the only bound known.
            num_target_layers=int(num_target_layers) if num_target_layers is not None else max(target_ids) + 1,
            target_layer_ids=tuple(int(i) for i in target_ids), block_size=int(value("block_size", 16)),
            mask_token_id=int(mask_token_id), conv_kernel_size=int(value("conv_kernel_size")),
            conv_group_size=int(value("conv_group_size")), selector_rank=int(value("selector_rank")),
            selector_top_k=int(value("selector_top_k")), output_multiplier=float(value("output_multiplier", 1.0)),
            # The reference applies no cap when the value is missing, zero or negative.
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "DFlashConfig":
        """Read `path`, a config.json or the checkpoint folder holding one."""
        p = Path(path)
        return cls.from_dict(json.loads((p / "config.json" if p.is_dir() else p).read_text()))

    def to_dict(self) -> dict[str, Any]:
        """The config.json a published DFlash2 checkpoint carries for these sizes (Qwen3 fields at the top, the
        drafter's own in `dflash_config`), so `from_dict(to_dict())` gives this config back."""
        cfg: dict[str, Any] = {
            "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps, "attention_bias": self.attention_bias,
            "hidden_act": "silu", "rope_theta": self.rope_theta, "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window is not None, "num_target_layers": self.num_target_layers,
            "block_size": self.block_size, "tie_word_embeddings": False,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                "block_size": self.block_size, "conv_kernel_size": self.conv_kernel_size,
                "conv_group_size": self.conv_group_size, "selector_rank": self.selector_rank,
                "selector_top_k": self.selector_top_k, "output_multiplier": self.output_multiplier,
                "final_logit_softcapping": self.final_logit_softcapping,
                "input_embedding_scale": self.input_embedding_scale,
            },
        }
        if self.sliding_window is not None:
            cfg["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            cfg["is_causal"] = self.is_causal
        return cfg


def _rope_theta(cfg: dict[str, Any]) -> float:
    """The rotary base. Only plain RoPE is implemented; a scaled variant is refused rather than run wrong."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"DFlash2 config: rope_type {kind!r} is not supported (only 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
