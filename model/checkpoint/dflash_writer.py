"""Write a tiny random DFlash2 drafter for a tiny target: config.json in the published spellings and one
model.safetensors with the published tensor names, sized to the target folder it drafts for.

The drafter shares the target's hidden size and vocabulary (it uses the target's embedding and lm_head), reads
five of its layers like the published GLM-5.3-Flash drafter, and is otherwise as small as a CPU test wants. Random
weights only: the published ones are non-commercial and not shipped. Output is byte-identical for a given seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from model.dflash import FULL_LAYER, SLIDING_LAYER, DFlashConfig, default_target_layer_ids, expected_shapes
from model.dflash.weights import save_checkpoint

DRAFTER_DIR = "dflash2"  # `make-tiny --drafter dflash` writes the drafter into this folder of the target's
MASK_TOKEN = "[MASK]"  # GLM's mask token, present in the tiny tokenizer as in the release's


def tiny_dflash_config(target: dict[str, Any], *, mask_token_id: int, layers: int = 5, window: int = 8,
                       block_size: int = 16) -> DFlashConfig:
    """The tiny drafter's config for a target config.json's contents (its `text_config` when it has one).

    The last layer attends to everything, the others through a `window`-position window: small enough that a test's
    context is longer than the window, so both attention kinds are exercised."""
    text = target.get("text_config", target)
    hidden, target_layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=int(text["vocab_size"]), rms_norm_eps=1e-6,
        attention_bias=False, rope_theta=10000.0, layer_types=(SLIDING_LAYER,) * (layers - 1) + (FULL_LAYER,),
        sliding_window=window, is_causal=None, num_target_layers=target_layers,
        target_layer_ids=tuple(default_target_layer_ids(target_layers, 5)), block_size=block_size,
        mask_token_id=mask_token_id, conv_kernel_size=4, conv_group_size=16, selector_rank=8, selector_top_k=8,
        output_multiplier=1.0, final_logit_softcapping=30.0, input_embedding_scale=1.0)


def random_tensors(config: DFlashConfig, seed: int) -> dict[str, torch.Tensor]:
    """fp32 weights for every published tensor, drawn in name order from one seeded generator.

    Scales keep a forward well-conditioned: linears ~ N(0, 1/fan_in), norms near 1, the convolutions near identity
    (tap 0 near 1, the other taps and the predicted kernels small), so no block dominates the residual stream."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(expected_shapes(config).items()):
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * noise
        elif name.endswith("base_kernel"):
            t = 0.1 * noise
            t[:, 0] += 1.0
        elif name.endswith("kernel_projection.weight"):
            t = 0.1 * noise / shape[1] ** 0.5
        elif name.endswith("codebook"):
            t = noise / config.selector_rank ** 0.5
        else:
            t = noise / shape[-1] ** 0.5
        out[name] = t
    return out


def write_tiny_dflash(out_dir: str | Path, target_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
                      mask_token_id: int | None = None) -> list[Path]:
    """Write the tiny drafter for the checkpoint in `target_dir` into `out_dir`; return the files written.

    mask_token_id: default the target tokenizer's `[MASK]`."""
    target_dir = Path(target_dir)
    if mask_token_id is None:
        mask_token_id = _added_token_id(target_dir / "tokenizer.json", MASK_TOKEN)
    config = tiny_dflash_config(json.loads((target_dir / "config.json").read_text()), mask_token_id=mask_token_id)
    return save_checkpoint(out_dir, config, random_tensors(config, seed), dtype=dtype)


def _added_token_id(tokenizer_json: Path, text: str) -> int:
    for tok in json.loads(tokenizer_json.read_text()).get("added_tokens", []):
        if tok["content"] == text:
            return int(tok["id"])
    raise ValueError(f"{tokenizer_json}: no added token {text!r}; pass mask_token_id")
