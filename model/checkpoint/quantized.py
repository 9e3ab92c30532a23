"""A tiny checkpoint's quantized linears, drawn at random in their packed form (any trellis word sequence is a valid
EXL3 weight, any bit stream valid int codes), so the CPU suite covers the quantized paths without an encoder run.
Which linears are packed is the quantize recipe's rule (quantize/select.py): every linear that is whole tiles of
the format on each of 4 virtual shards.

EXL3 (`make-tiny --format exl3[:BITS]`): the tiny model widened so its MLPs fit EXL3's 128-wide Hadamard blocks even
when cut into 4 tensor-parallel shards (EXL3_DIMS, also `--preset exl3` for a dense model to quantize): the dense
MLP, the shared and routed experts and the MTP's eh_proj are EXL3, lm_head stays dense (`head_bits` 16); each one's
bits per weight come from the target average by quantize/bits.py's rule, recorded in quantization_config.json.
Attention stays in the checkpoint dtype whatever its dims (the seed's layout: EXL3 experts, 16-bit attention), which
is also what exllamav3 can load beside twinspark's key names: it reads `kv_b_proj.weight` raw (modules/mla_attn.py)
and takes KDA's q/k/v as EXL3 only fused into one `qkv_proj` (modules/gated_delta_net.py: the separate q/k/v keys
are its fp16 fallback).

int (`make-tiny --format int2|int3|int4|int8[:gGROUP]`): the tiny model with routed experts 128 wide (INT_DIMS), the
smallest width at which every MLP linear, the experts' down_proj included, is whole groups of 32 on each of 4 virtual
shards; every linear the recipe packs, attention included, is random codes with bfloat16 scales in groups of GROUP,
by default the group `twinspark quantize` would choose at these dims (select.auto_block: 32 for int3, 16 for the
other widths, where KDA's and MLA's o_proj, 16 wide per shard, fit too).

A recipe (`make-tiny --format int3+fp8+fp8`) mixes them as `twinspark quantize` would: each linear in its part's
format, fp8 and w4a16 drawn at random too, the block chosen as quantize chooses it (`auto_block`: an int format
without its own group shares it, so int3:g32+fp8+fp8 keeps fp8 at 8 x 8 blocks, where the tiny lm_head fits), the
dims of its widest format (EXL3's, else the int formats').
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kernels.quant import random_quantized
from model.quantize import bits as exl3_bits
from model.quantize.convert import recipe_quant_config
from model.quantize.select import INT_CODEC, Recipe, auto_block, codec_format

from .presets import EXL3_DIMS, INT_DIMS
from .tensor_spec import TensorSpec, key_seed, materialize

__all__ = ["Packing", "dims_for", "make_tensors", "materialize"]

ATTENTION = ".self_attn."  # every attention tensor's key (MLA + indexer, KDA) has it


def dims_for(recipe: Recipe | None) -> dict[str, Any]:
    """The TinySpec overrides a recipe's tiny checkpoint is written at (a preset's come on top)."""
    formats = recipe.formats if recipe is not None else ()
    if "exl3" in formats:
        return EXL3_DIMS
    return INT_DIMS if any(codec_format(f)[0] == INT_CODEC for f in formats) else {}


@dataclass(frozen=True)
class Packing:
    """What make-tiny stores quantized: the recipe (its block chosen as quantize would, `auto_block`), each packed
    linear's format, and EXL3's bits per linear."""

    recipe: Recipe
    formats: dict[str, str]  # weight key -> its format (the rest stays dense)
    exl3: exl3_bits.BitPlan | None = None

    @classmethod
    def plan(cls, recipe: Recipe, specs: list[TensorSpec]) -> "Packing":
        """Raises ValueError for a bitrate, group or lm_head the recipe cannot store (before anything is written)."""
        recipe = dataclasses.replace(recipe, block=auto_block(recipe, [(s.key, s.shape) for s in specs]))
        formats = {s.key: fmt for s in specs if (fmt := _format_of(recipe, s)) is not None}
        exl3 = {s.key: s.numel for s in specs if formats.get(s.key) == "exl3"}
        return cls(recipe, formats, exl3_bits.plan(exl3, recipe.exl3_bits, recipe.exl3_codebook) if exl3 else None)

    @property
    def group(self) -> int | None:
        """The int formats' group size (None: no int linear)."""
        ints = [f for f in self.formats.values() if codec_format(f)[0] == INT_CODEC]
        return self.recipe.block_for(ints[0]) if ints else None

    def quantization_config(self) -> dict[str, Any] | None:
        return recipe_quant_config(self.recipe, set(self.formats.values()), self.exl3)


def _format_of(recipe: Recipe, spec: TensorSpec) -> str | None:
    """The format `spec` is stored in (None: dense); EXL3 keeps attention dense (see the module note)."""
    fmt = recipe.format_for(spec.key, spec.shape)
    return None if fmt == "exl3" and ATTENTION in spec.key else fmt


def make_tensors(spec: TensorSpec, seed: int, dtype: torch.dtype, packing: Packing | None) -> dict[str, torch.Tensor]:
    """The stored tensors of one spec: the dense tensor, or a packed linear's tensors drawn with the spec's own seed
    (so the values do not depend on which other tensors exist), EXL3 at its planned rate."""
    fmt = packing.formats.get(spec.key) if packing is not None else None
    if fmt is None:
        return {spec.key: materialize(spec, seed, dtype)}
    codec, bits = codec_format(fmt)
    g = torch.Generator().manual_seed(key_seed(seed, spec.key))
    q = random_quantized(codec, *spec.shape, std=spec.init.a, block=packing.recipe.block_for(fmt),
                         bits=packing.exl3.bits[spec.key] if codec == "exl3" else bits,
                         codebook=packing.recipe.exl3_codebook, generator=g)
    module = spec.key.removesuffix(".weight")
    return {f"{module}.{name}": t for name, t in q.tensors.items()}
