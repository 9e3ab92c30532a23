"""The quantize plan (model/quantize/select.py, bits.py): the recipe syntax with EXL3 bitrates and int group sizes,
which linears fit the virtual shards, the fp8 block / w4a16 or int group chosen from the shard plan, and EXL3's bits
per linear."""

from __future__ import annotations

import pytest

from bench.random_weights import bench_spec
from kernels.quant import intn
from model.checkpoint.spec import TinySpec
from model.checkpoint.weights import all_tensors
from model.quantize.bits import plan, rates
from model.quantize.select import (FORMATS, INT_FORMATS, RECIPE_HELP, FormatSpec, Recipe, auto_block, codec_format,
                                   cut_dims, fits, format_and_bits, parse_format, recipe_and_bits)
from services.common import shared_flags

L = "model.language_model.layers."


def test_recipes_take_an_exl3_bitrate_wherever_a_format_goes():
    r = Recipe.parse("exl3:3.0+fp8")
    assert (r.experts, r.other, r.exl3_bits) == ("exl3", "fp8", 3.0)
    assert Recipe.parse("w4a16+exl3:2.5").exl3_bits == 2.5
    assert Recipe.parse("exl3").exl3_bits == 4.0 and Recipe.parse("exl3:2+bf16").other is None
    assert parse_format("exl3:2.5") == FormatSpec("exl3", exl3_bits=2.5) and parse_format("fp8") == FormatSpec("fp8")
    assert format_and_bits("exl3", 3.0) == FormatSpec("exl3", exl3_bits=3.0) == format_and_bits("exl3:3", 3.0)


@pytest.mark.parametrize("spec, experts, other, group", [
    ("int3+fp8", "int3", "fp8", None), ("int3+int4", "int3", "int4", None), ("int3:g64+fp8", "int3", "fp8", 64),
    ("int4", "int4", "int4", None), ("exl3:2.5+int4", "exl3", "int4", None), ("int3+bf16", "int3", None, None),
    ("int8:g32", "int8", "int8", 32), ("int2+int4:g128", "int2", "int4", 128)])
def test_recipes_take_the_int_formats_with_one_group(spec, experts, other, group):
    r = Recipe.parse(spec)
    assert (r.experts, r.other, r.group) == (experts, other, group)
    assert r.block_for("int3") == (group or r.block) and r.block_for("fp8") == r.block


@pytest.mark.parametrize("spec, experts, other, head", [
    ("int3+fp8+fp8", "int3", "fp8", "fp8"), ("exl3:2.5+fp8+fp8", "exl3", "fp8", "fp8"),
    ("int3+bf16+fp8", "int3", None, "fp8"), ("int3+fp8+bf16", "int3", "fp8", None), ("int3+fp8", "int3", "fp8", None),
    ("fp8", "fp8", "fp8", None)])
def test_a_third_term_gives_lm_heads_format(spec, experts, other, head):
    r = Recipe.parse(spec, virtual=2)
    assert (r.experts, r.other, r.head) == (experts, other, head)
    assert r.format_for("lm_head.weight", (154880, 4096)) == head  # the release's: 605 blocks of 128 rows a shard
    assert r.formats == tuple(dict.fromkeys(f for f in (experts, other, head) if f))


def test_lm_head_in_fp8_fits_the_virtual_shards_or_is_refused():
    real = dict((t.key, t.shape) for t in all_tensors(bench_spec(layers=4)))
    head = real["lm_head.weight"]  # [154880, 4096]: 1,210 blocks of 128 rows
    assert Recipe.parse("int3+fp8+fp8", virtual=2).format_for("lm_head.weight", head) == "fp8"
    with pytest.raises(ValueError, match=r"not whole fp8 blocks of 128 x 128 on each of 4 virtual shards \(38720"):
        Recipe.parse("int3+fp8+fp8").format_for("lm_head.weight", head)
    assert Recipe.parse("int3+fp8").format_for("lm_head.weight", head) is None  # bf16 by default, as before
    # the head takes the block the rest chose: at 4 shards it would fit 64-row blocks, and must not pull fp8 off 128
    assert auto_block(Recipe.parse("int3+fp8+fp8"), list(real.items())) == 128


def test_an_int_format_name_is_the_int_codec_at_its_bits():
    assert [codec_format(f) for f in INT_FORMATS] == [("int", b) for b in intn.BITS]  # select names intn's widths
    assert codec_format("fp8") == ("fp8", None) and codec_format("exl3") == ("exl3", None)
    assert parse_format("int3:g64") == FormatSpec("int3", group=64)


def test_the_random_weights_flag_names_every_format():
    assert all(f in shared_flags.RANDOM_WEIGHTS.help for f in FORMATS)
    assert all("EXPERTS+OTHER[+HEAD]" in text and "int3+fp8+fp8" in text
               for text in (shared_flags.RANDOM_WEIGHTS.help, RECIPE_HELP))


@pytest.mark.parametrize("spec, message", [("exl3:9", "from 1 to 8"), ("exl3:abc", "from 1 to 8"),
                                           ("exl3:", "from 1 to 8"), ("exl3:nan", "from 1 to 8"),
                                           ("fp8:3", "only exl3 takes a bitrate"),
                                           ("exl3:2+exl3:3", "one EXL3 bitrate per recipe"),
                                           ("int5", "fp8, w4a16, exl3, int2, int3, int4, int8, bf16"),
                                           ("fp8+fp8+fp8+fp8", r"or EXPERTS\+OTHER\[\+HEAD\]"),
                                           ("int3+fp8+int4", "HEAD int4: lm_head is kept bf16 or stored in fp8"),
                                           ("fp8+fp8+exl3", "the one format with a fast product"),
                                           ("int3:g64+int4:g128", "one int group size per recipe"),
                                           ("int3:64", r"group size as :gGROUP"), ("int3:g", r"group size as :gGROUP"),
                                           ("fp8:g64", "only the int formats a group size"),
                                           ("int3:g16", "multiple of 32"), ("int3:g48+fp8", "multiple of 32"),
                                           ("int4:g12", "group size times the bits must be a multiple of 32")])
def test_bad_recipes_say_why(spec, message):
    with pytest.raises(ValueError, match=message):
        Recipe.parse(spec)


def test_bits_flag_and_format_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        format_and_bits("exl3:3", 2.0)
    with pytest.raises(ValueError, match="EXL3's bits per weight"):
        format_and_bits("fp8", 2.0)
    assert recipe_and_bits("exl3+fp8+fp8", 2.5) == Recipe.parse("exl3:2.5+fp8+fp8")  # --bits folded into a recipe
    with pytest.raises(ValueError, match="EXL3's bits per weight"):
        recipe_and_bits("int3+fp8+fp8", 2.5)


def test_each_linear_is_cut_along_the_dims_the_model_splits():
    assert cut_dims(L + "1.mlp.experts.3.down_proj.weight") == (1,)
    assert cut_dims(L + "0.self_attn.o_proj.weight") == (1,)
    assert cut_dims(L + "1.mlp.shared_experts.gate_proj.weight") == (0,)
    assert cut_dims(L + "3.self_attn.kv_b_proj.weight") == (0,)
    assert cut_dims(L + "3.self_attn.q_a_proj.weight") == () == cut_dims(L + "8.eh_proj.weight")
    assert cut_dims(L + "0.self_attn.something_new.weight") == (0, 1)  # unknown: every cut must fit


def test_a_linear_fits_when_each_virtual_shard_is_whole_tiles():
    # An expert's gate_proj [32, 64] of the tiny model: 4 shards of 8 rows.
    assert fits("fp8", (32, 64), 8, 4, (0,)) and not fits("fp8", (32, 64), 16, 4, (0,))
    assert fits("fp8", (32, 64), 16, 1, (0,))  # one virtual shard: whole blocks are enough
    # w4a16 groups run along the input dim only: a column-parallel cut never splits one.
    assert fits("w4a16", (32, 128), 128, 4, (0,)) and not fits("w4a16", (64, 128), 128, 4, (1,))
    # EXL3: the make-tiny EXL3 MLP [512, 128] cut by rows, its down_proj [128, 512] by columns; not the other way.
    assert fits("exl3", (512, 128), None, 4, (0,)) and fits("exl3", (128, 512), None, 4, (1,))
    assert not fits("exl3", (128, 512), None, 4, (0,)) and not fits("exl3", (64, 128), None, 1, ())


def _tensors(spec: TinySpec) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.key, t.shape) for t in all_tensors(spec)]


@pytest.mark.parametrize("fmt, smallest, packed", [("int3", 32, 181), ("int2", 16, 190)])
def test_an_int_group_is_whole_words(fmt, smallest, packed):
    tiny = _tensors(TinySpec.tiny(vocab_size=1088))
    block = auto_block(Recipe(fmt, fmt), tiny)  # only whole-word groups are tried: 8 x 3 bits is no word
    assert block == smallest
    assert sum(Recipe(fmt, fmt, block=block).format_for(k, s) is not None for k, s in tiny) == packed
    assert fits(fmt, (64, 64), 32, 4, (0,)) and not fits(fmt, (64, 64), 32, 4, (1,))  # groups along the input dim
    with pytest.raises(ValueError, match=f"{fmt}: groups of 8 do not fill whole int32 words"):
        Recipe(fmt, fmt, block=8)


@pytest.mark.parametrize("fmt", ["fp8", "w4a16", "int4"])
def test_the_block_comes_from_the_shard_plan(fmt):
    tiny = _tensors(TinySpec.tiny(vocab_size=1088))
    assert auto_block(Recipe(fmt, fmt), tiny) == 8  # 32 expert channels / 4 shards
    assert auto_block(Recipe(fmt, fmt, virtual=1), tiny) == 32  # unsplit, the 32-wide linears set it
    real = [(t.key, t.shape) for t in all_tensors(bench_spec(layers=4))]
    assert auto_block(Recipe(fmt, fmt), real) == 128
    # the block chosen packs every linear the smallest candidate packs
    for block in (8, auto_block(Recipe(fmt, fmt), tiny)):
        r = Recipe(fmt, fmt, block=block)
        assert sum(r.format_for(k, s) is not None for k, s in tiny) == 262  # with MLA's q_b and kv_b (2 x 3 layers)


def _linears() -> dict[str, int]:
    """Two MoE layers of 4 experts + attention + a shared expert, and one dense MLP layer before them."""
    out = {f"{L}0.mlp.{p}_proj.weight": 1000 for p in ("gate", "up", "down")}
    for layer in (1, 2, 3):
        out[f"{L}{layer}.self_attn.q_b_proj.weight"] = 500
        out.update({f"{L}{layer}.mlp.experts.{e}.{p}_proj.weight": 1000 for e in range(4)
                    for p in ("gate", "up", "down")})
        out.update({f"{L}{layer}.mlp.shared_experts.{p}_proj.weight": 1000 for p in ("gate", "up", "down")})
    return out


def test_a_target_that_is_a_rate_gives_every_linear_that_rate():
    for target, codebook in ((3.0, "mcg"), (2.5, "mul1"), (8, "3inst")):
        p = plan(_linears(), target, codebook)
        assert set(p.bits.values()) == {target} and p.average == target
    assert rates("mul1") == (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8) and 2.5 not in rates("mcg")


def test_a_fractional_target_promotes_groups_in_the_rules_order():
    linears = _linears()
    p = plan(linears, 2.5, "mcg")  # no half rate for mcg: 2 and 3 bits
    assert set(p.bits.values()) == {2, 3} and 2.25 < p.average <= 2.5
    assert p.average == sum(p.bits[k] * n for k, n in linears.items()) / sum(linears.values())
    # attention first, then shared experts and the dense MLP, end layers (1 and 3) before the middle one
    assert all(p.bits[f"{L}{layer}.self_attn.q_b_proj.weight"] == 3 for layer in (1, 2, 3))
    shared = [p.bits[f"{L}{layer}.mlp.shared_experts.up_proj.weight"] for layer in (1, 2, 3)]
    assert shared[0] == shared[2] == 3
    # a layer's routed experts always share one rate (the fused MoE kernels stack them)
    for layer in (1, 2, 3):
        assert len({b for k, b in p.bits.items() if f"{L}{layer}.mlp.experts." in k}) == 1
    assert "linears at 2" in p.summary() and "bits per weight on average" in p.summary()


def test_half_rates_fill_in_with_mul1():
    p = plan(_linears(), 3.2, "mul1")
    assert set(p.bits.values()) == {3, 3.5} and 3.0 < p.average <= 3.2


@pytest.mark.parametrize("target", [0.5, 9, float("nan")])
def test_targets_outside_exllamav3s_range_are_refused(target):
    with pytest.raises(ValueError, match="from 1 to 8"):
        plan(_linears(), target, "mul1")
