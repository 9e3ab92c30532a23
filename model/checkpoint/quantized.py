"""A tiny checkpoint's EXL3 linears: random trellis words (any word sequence is a valid EXL3 weight), so the CPU
suite covers the EXL3 path without exllamav3's GPU converter.

`make-tiny --format exl3` widens the tiny model so its MLPs fit EXL3's 128-wide Hadamard blocks even when cut into
4 tensor-parallel shards (EXL3_DIMS). Which MLP linears become EXL3 is the quantize recipe's rule
(quantize/select.py): every linear whose dims are multiples of 128 — the dense MLP, the shared and routed experts
and the MTP's eh_proj — and lm_head stays dense (`head_bits` 16). Attention stays in the checkpoint dtype whatever
its dims (the seed's layout: EXL3 experts, 16-bit attention), which is also what exllamav3 can load beside
twinspark's key names: it reads `kv_b_proj.weight` raw (modules/mla_attn.py) and takes KDA's q/k/v as EXL3 only
fused into one `qkv_proj` (modules/gated_delta_net.py: the separate q/k/v keys are its fp16 fallback).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.quant import exl3
from model.quantize.select import Recipe

from .tensor_spec import TensorSpec, key_seed, materialize

FORMATS = ("dense", "exl3")
EXL3_DIMS = dict(hidden_size=128, intermediate_size=512, moe_intermediate_size=512)  # 512 = 4 shards x 128
ATTENTION = ".self_attn."  # every attention tensor's key (MLA + indexer, KDA) has it


def exl3_recipe(bits: float, codebook: str) -> Recipe:
    return Recipe(experts="exl3", other="exl3", exl3_bits=bits, exl3_codebook=codebook)


def exl3_quant_config(bits: float, codebook: str) -> dict[str, Any]:
    """exllamav3's `quantization_config` fields (conversion/compile.py) for a random-trellis checkpoint."""
    return {"quant_method": exl3.QUANT_METHOD, "bits": bits, "head_bits": 16, "codebook": codebook,
            "calibration": None}


def make_tensors(spec: TensorSpec, seed: int, dtype: torch.dtype, recipe: Recipe | None) -> dict[str, torch.Tensor]:
    """The stored tensors of one spec: the dense tensor, or an EXL3 MLP linear's trellis / suh / svh / marker drawn
    with the spec's own seed (so the values do not depend on which other tensors exist)."""
    if recipe is None or ATTENTION in spec.key or recipe.format_for(spec.key, spec.shape) != "exl3":
        return {spec.key: materialize(spec, seed, dtype)}
    out, inp = spec.shape
    g = torch.Generator().manual_seed(key_seed(seed, spec.key))
    tensors = exl3.random_linear(out, inp, std=spec.init.a, bits=recipe.exl3_bits, codebook_name=recipe.exl3_codebook,
                                 generator=g)
    module = spec.key.removesuffix(".weight")
    return {f"{module}.{name}": t for name, t in tensors.items()}
