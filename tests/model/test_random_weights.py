"""Random weights drawn in place of shards (`serve-rank --random-weights`), at tiny dims on the CPU: the key list
follows the checkpoint's config, quantized linears are drawn packed (never dense), shards are cut from the draw."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kernels.quant import QuantizedWeight
from model.batch import Batch
from model.config import ModelConfig
from model.model import Glm5Model
from model.parallel import Collective, Sharding
from model.quantize.select import Recipe
from model.random_weights import RandomWeightReader, spec_from_config
from tests.model.quant_helpers import QUANT_BLOCK

TEXT = "model.language_model."
EXPERT = TEXT + "layers.1.mlp.experts.2.gate_proj.weight"
ATTN = TEXT + "layers.0.self_attn.o_proj.weight"
PACKED_DTYPE = {"fp8": torch.float8_e4m3fn, "w4a16": torch.int32, "int": torch.int32, "exl3": torch.int16}


def _reader(ckpt, spec: str, rank: int = 0, world: int = 1) -> RandomWeightReader:
    cfg = ModelConfig.from_pretrained(ckpt)
    return RandomWeightReader(spec_from_config(cfg), Sharding(rank=rank, world=world), torch.float32, "cpu",
                              recipe=Recipe.parse(spec, block=QUANT_BLOCK))


@pytest.mark.parametrize("ckpt", ["tiny_default", "tiny_exl3"])
def test_tensors_are_the_checkpoints(ckpt, request):
    path = request.getfixturevalue(ckpt)
    shapes = {}
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys() if not k.startswith("model.visual.")})
    exl3_names = ("trellis", "suh", "svh", "mul1")  # the EXL3 tensors a quantized `X.weight` is stored as
    logical = {k.rpartition(".")[0] + ".weight" if k.rpartition(".")[2] in exl3_names else k for k in shapes}
    drawn = {k: t.shape for k, t in _reader(path, "bf16").tensors.items()}
    assert set(drawn) == logical
    assert all(drawn[k] == shapes[k] for k in drawn if k in shapes)


# (int3 groups are whole words, 32 at the least: a recipe's :g32 overrides the block of 8 the fp8 linears take)
@pytest.mark.parametrize("spec, expert_fmt, attn_fmt, head_fmt", [
    ("w4a16+fp8", "w4a16", "fp8", None), ("fp8", "fp8", "fp8", None), ("w4a16+bf16", "w4a16", None, None),
    ("int3:g32+fp8", "int", "fp8", None), ("int3:g32+fp8+fp8", "int", "fp8", "fp8"),
    ("w4a16+bf16+fp8", "w4a16", None, "fp8")])
def test_quantized_linears_are_drawn_packed(tiny_default, spec, expert_fmt, attn_fmt, head_fmt):
    reader = _reader(tiny_default, spec)
    for key, dim, fmt in ((EXPERT, 0, expert_fmt), (ATTN, 1, attn_fmt), ("lm_head.weight", 0, head_fmt)):
        packed = reader.split_packed(key, dim)
        if fmt is None:
            assert all(isinstance(p, torch.Tensor) for p in packed)
            continue
        assert all(isinstance(p, QuantizedWeight) and p.format == fmt for p in packed)
        assert all(t.dtype == PACKED_DTYPE[fmt] for p in packed for n, t in p.tensors.items()
                   if n in ("weight", "weight_packed", "trellis"))
        dense = reader.split(key, dim)  # the same draw (per-key seed), dequantized
        assert all(torch.equal(p.dequantize(), d) for p, d in zip(packed, dense))
    assert reader.quantized_made > 0


def test_each_rank_cuts_its_shards_from_the_same_draw(tiny_exl3):
    whole = _reader(tiny_exl3, "exl3").split_packed(EXPERT.replace("layers.1", "layers.2"), 0)
    rank1 = _reader(tiny_exl3, "exl3", rank=1, world=2).split_packed(EXPERT.replace("layers.1", "layers.2"), 0)
    assert [p.format for p in rank1] == ["exl3", "exl3"]
    for mine, ref in zip(rank1, whole[2:]):
        assert all(torch.equal(mine.tensors[n], ref.tensors[n]) for n in ref.tensors)


@pytest.mark.parametrize("ckpt, spec", [("tiny_default", "w4a16+fp8"), ("tiny_exl3", "exl3+bf16"),
                                        ("tiny_default", "int3:g32+fp8"), ("tiny_default", "int3:g32+fp8+fp8")])
def test_model_runs_on_random_quantized_weights(ckpt, spec, request):
    path = request.getfixturevalue(ckpt)
    cfg = ModelConfig.from_pretrained(path)
    reader = _reader(path, spec)
    model = Glm5Model(cfg, reader, Collective(reader.sharding))
    cache = model.new_cache(num_blocks=4, block_size=16, num_slots=1)
    out = model.forward(Batch.single(list(range(1, 20)), 0, [0, 1, 2, 3]), cache)
    assert out.logits.shape == (1, cfg.vocab_size) and torch.isfinite(out.logits).all()
    assert model.mtp is not None  # the config's MTP layer is drawn too


def test_bad_recipe_names_the_choices():
    with pytest.raises(ValueError, match="fp8, w4a16, exl3, int2, int3, int4, int8, bf16"):
        Recipe.parse("int5")


def test_int_linears_are_drawn_at_their_widths_in_the_recipes_group(tiny_default):
    reader = _reader(tiny_default, "int3:g32+int4")
    expert, attn = reader.full_packed(EXPERT), reader.full_packed(TEXT + "layers.0.self_attn.q_proj.weight")
    assert (expert.format, expert.params) == ("int", {"bits": 3, "group": 32})
    assert (attn.format, attn.params) == ("int", {"bits": 4, "group": 32})
    assert expert.tensors["weight_packed"].shape == (32, 64 * 3 // 32)  # the packed words, never a dense copy


def test_an_exl3_bitrate_recipe_draws_each_linear_at_its_planned_rate(tiny_exl3):
    cfg = ModelConfig.from_pretrained(tiny_exl3)
    reader = RandomWeightReader(spec_from_config(cfg), Sharding(), torch.float32, "cpu",
                                recipe=Recipe.parse("exl3:2.5+bf16", exl3_codebook="mcg"))
    bits = reader.exl3_plan.bits
    assert set(bits.values()) == {2, 3} and all(".mlp.experts." in k for k in bits)  # +bf16: routed experts only
    for key in (EXPERT, EXPERT.replace("layers.1", "layers.2")):
        assert reader.full_packed(key).params == {"bits": bits[key], "codebook": "mcg"}
