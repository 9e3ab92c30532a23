"""A tiny checkpoint's EXL3 linears: random trellis words (any word sequence is a valid EXL3 weight), so the CPU
suite covers the EXL3 path without an encoder run.

`make-tiny --format exl3` widens the tiny model so its MLPs fit EXL3's 128-wide Hadamard blocks even when cut into
4 tensor-parallel shards (EXL3_DIMS, also `--preset exl3` for a dense model to quantize). Which MLP linears become
EXL3 is the quantize recipe's rule (quantize/select.py): every linear that is whole 128 x 128 tiles on each virtual
shard — the dense MLP, the shared and routed experts and the MTP's eh_proj — and lm_head stays dense (`head_bits`
16); each one's bits per weight come from the target average by quantize/bits.py's rule, recorded in
quantization_config.json. Attention stays in the checkpoint dtype whatever its dims (the seed's layout: EXL3
experts, 16-bit attention), which is also what exllamav3 can load beside twinspark's key names: it reads
`kv_b_proj.weight` raw (modules/mla_attn.py) and takes KDA's q/k/v as EXL3 only fused into one `qkv_proj`
(modules/gated_delta_net.py: the separate q/k/v keys are its fp16 fallback).
"""

from __future__ import annotations

import torch

from kernels.quant import exl3
from model.quantize import bits as exl3_bits
from model.quantize.select import Recipe

from .presets import EXL3_DIMS
from .tensor_spec import TensorSpec, key_seed, materialize

__all__ = ["EXL3_DIMS", "FORMATS", "exl3_plan", "exl3_recipe", "make_tensors"]

FORMATS = ("dense", "exl3")
ATTENTION = ".self_attn."  # every attention tensor's key (MLA + indexer, KDA) has it


def exl3_recipe(bits: float, codebook: str) -> Recipe:
    return Recipe(experts="exl3", other="exl3", exl3_bits=bits, exl3_codebook=codebook)


def _is_exl3(spec: TensorSpec, recipe: Recipe) -> bool:
    return ATTENTION not in spec.key and recipe.format_for(spec.key, spec.shape) == "exl3"


def exl3_plan(specs: list[TensorSpec], recipe: Recipe) -> exl3_bits.BitPlan:
    """The bits per weight of every linear make-tiny writes as EXL3."""
    return exl3_bits.plan({s.key: s.numel for s in specs if _is_exl3(s, recipe)}, recipe.exl3_bits,
                          recipe.exl3_codebook)


def make_tensors(spec: TensorSpec, seed: int, dtype: torch.dtype, recipe: Recipe | None,
                 plan: exl3_bits.BitPlan | None) -> dict[str, torch.Tensor]:
    """The stored tensors of one spec: the dense tensor, or an EXL3 MLP linear's trellis / suh / svh / marker drawn
    with the spec's own seed (so the values do not depend on which other tensors exist) at its planned rate."""
    if recipe is None or plan is None or not _is_exl3(spec, recipe):
        return {spec.key: materialize(spec, seed, dtype)}
    out, inp = spec.shape
    g = torch.Generator().manual_seed(key_seed(seed, spec.key))
    tensors = exl3.random_linear(out, inp, std=spec.init.a, bits=plan.bits[spec.key],
                                 codebook_name=recipe.exl3_codebook, generator=g)
    module = spec.key.removesuffix(".weight")
    return {f"{module}.{name}": t for name, t in tensors.items()}
