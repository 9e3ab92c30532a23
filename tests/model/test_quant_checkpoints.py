"""Quantized checkpoints run through the model (CPU, fp32):

- bit for bit the logits of a dense checkpoint written from their own dequantized weights (the loader's per-shard
  dequantization equals dequantizing whole tensors, and the model never sees the format);
- within a stated distance of the unquantized model they were made from (fp8, w4a16, int4, int3, and EXL3 from
  twinspark's encoder on the EXL3-wide tiny model; make-tiny's EXL3 checkpoint is random trellises, with no unquantized
  original). Measured on a 2-layer tiny model: the 8-layer one is chaotic
  (2% random noise on any one group of weights moves some logit by 3 standard deviations somewhere in 48 rows), so
  the distance is the median over rows of the logits' cosine similarity, which is stable. For scale, the same model
  with relative noise of 2% / 5% on its MLP and attention weights measured 0.9983-0.9987 / 0.9873-0.9898;
- lm_head in fp8 (the recipe int4+fp8+fp8, written in one run) the same: the model, and the DFlash trainer's dense
  read of the target's lm_head, see its dequantized weights;
- TP = 2 bit-identical to TP = 1 (each rank cuts its shards from the stored tensors on the format's tile grid), on
  mixed checkpoints that hold every format between them: EXL3 MLPs + fp8 attention (fp8 quantized on top of the
  EXL3 tiny model), W4A16 experts + fp8 for the rest (`quantize --experts-only` w4a16, then fp8), and int3 experts +
  int4 for the rest (the int format run twice, in groups of 32).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from model.dflash.train.traces import target_embed_head
from model.model import Glm5Model
from model.quantize.convert import quantize_checkpoint
from model.quantize.select import Recipe
from model.checkpoint import make_tiny
from services.rank_worker.offline import run_on_ranks
from tests.model.quant_helpers import QUANT_BLOCK, prompt_logits, write_dequantized
from tests.model.reference import random_ids
from tests.model.tp_jobs import logits_and_greedy

IDS = random_ids(48, seed=5)
FORMATS = ["tiny_fp8", "tiny_w4a16", "tiny_int3", "tiny_exl3", "tiny_fp8_head"]
# Against the unquantized 2-layer model, over the 48 rows of IDS: (median cosine similarity of the logits, share of
# rows with the same top-1 token) at least. Measured: fp8 (8x8 blocks) 0.9985 / 0.896, w4a16 (groups of 8) 0.9879 /
# 0.646 — fp8 as close as 2% noise, w4a16 as 5%; int4 (groups of 8, all 16 levels with its signed scales) 0.9898 /
# 0.646, int3 (groups of 32, its smallest) 0.9244 / 0.396 (int2 in groups of 16: 0.738 / 0.21).
TOLERANCE = {"fp8": (0.995, 0.8), "w4a16": (0.97, 0.5), "int4": (0.97, 0.5), "int3": (0.9, 0.3)}
BLOCK = {"int3": 32}  # an int3 group is whole 32-bit words; the rest take QUANT_BLOCK
# EXL3 at 3 bits per weight on the MLPs of `make-tiny --preset exl3 --layers 2 --experts 2` (attention does not fit
# its 128 x 128 tiles there): measured 0.9682 / 0.583 (2 bits 0.893 / 0.33, 4 bits 0.990 / 0.77).
EXL3_TOLERANCE = (0.95, 0.45)


def _load(path) -> Glm5Model:
    return Glm5Model.load(path, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("ckpt", FORMATS)
def test_logits_equal_the_dense_checkpoint_of_its_dequantized_weights(ckpt, request, tmp_path):
    path = request.getfixturevalue(ckpt)
    dense = write_dequantized(path, tmp_path / "dense")
    got, want = prompt_logits(_load(path), IDS[:40]), prompt_logits(_load(dense), IDS[:40])
    assert torch.equal(got, want), f"max |d| {(got - want).abs().max():.3e}"


def test_the_dflash_trainer_reads_an_fp8_lm_head_dequantized(tiny_fp8_head, tmp_path):
    stored = json.loads((tiny_fp8_head / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight_scale_inv" in stored  # lm_head is stored in fp8 blocks
    dense = write_dequantized(tiny_fp8_head, tmp_path / "dense")
    head = target_embed_head(tiny_fp8_head)[1]
    assert head.dtype == torch.float32 and torch.equal(head, target_embed_head(dense)[1])


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("two_layers") / "ckpt", layers=2, layer_pattern="KM")


@pytest.mark.parametrize("fmt", sorted(TOLERANCE))
def test_logits_close_to_the_unquantized_model(fmt, two_layers, tmp_path):
    quantize_checkpoint(two_layers, tmp_path / fmt, Recipe(fmt, fmt, block=BLOCK.get(fmt, QUANT_BLOCK)), progress=False)
    got, ref = prompt_logits(_load(tmp_path / fmt), IDS), prompt_logits(_load(two_layers), IDS)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1).median().item()
    same_top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{fmt}: median cosine {cos:.4f}, top-1 unchanged on {same_top1:.1%} of {len(IDS)} rows")
    min_cos, min_same = TOLERANCE[fmt]
    assert cos >= min_cos and same_top1 >= min_same


def test_exl3_logits_close_to_the_unquantized_model(tmp_path):
    src = make_tiny(tmp_path / "wide", layers=2, experts=2, layer_pattern="KM", preset="exl3")
    quantize_checkpoint(src, tmp_path / "exl3", Recipe("exl3", "exl3", exl3_bits=3), progress=False)
    got, ref = prompt_logits(_load(tmp_path / "exl3"), IDS), prompt_logits(_load(src), IDS)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1).median().item()
    same_top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"exl3 3 bpw: median cosine {cos:.4f}, top-1 unchanged on {same_top1:.1%} of {len(IDS)} rows")
    assert cos >= EXL3_TOLERANCE[0] and same_top1 >= EXL3_TOLERANCE[1]


@pytest.fixture(scope="module")
def mixed(tiny_exl3, tiny_default, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixed")
    fp8 = Recipe("fp8", "fp8", block=QUANT_BLOCK)
    quantize_checkpoint(tiny_exl3, root / "exl3+fp8", fp8, progress=False)
    quantize_checkpoint(tiny_default, root / "w4a16", Recipe("w4a16", None, block=QUANT_BLOCK), progress=False)
    quantize_checkpoint(root / "w4a16", root / "w4a16+fp8", fp8, progress=False)
    quantize_checkpoint(tiny_default, root / "int3", Recipe("int3", None, block=32), progress=False)
    quantize_checkpoint(root / "int3", root / "int3+int4", Recipe("int4", "int4", block=32), progress=False)
    return {name: root / name for name in ("exl3+fp8", "w4a16+fp8", "int3+int4")}


# Each mixed checkpoint's formats: (codecs, quant_methods in config.json, the int widths).
HOLDS = {"exl3+fp8": ({"exl3", "fp8"}, {"exl3", "fp8"}, set()),
         "w4a16+fp8": ({"w4a16", "fp8"}, {"twinspark_w4a16", "fp8"}, set()),
         "int3+int4": ({"int"}, {"twinspark_int"}, {3, 4})}


def test_mixed_checkpoints_hold_every_format(mixed):
    from model.parallel import Sharding
    from model.weights import WeightReader

    for name, path in mixed.items():
        reader = WeightReader(path, Sharding(), torch.float32, torch.device("cpu"), progress=False)
        codecs, methods, widths = HOLDS[name]
        assert {c.name for c in reader.quantized.values()} == codecs, name
        assert set(reader.quant_configs) == methods, name
        keys = [m + ".weight" for m, c in reader.quantized.items() if c.name == "int"]
        assert {reader.full_packed(k).params["bits"] for k in keys} == widths, name


@pytest.mark.tp
@pytest.mark.parametrize("name", ["exl3+fp8", "w4a16+fp8", "int3+int4"])
def test_tp2_equals_tp1(name, mixed):
    path = mixed[name]
    job = partial(logits_and_greedy, ids=IDS[:40], prompt_len=32, max_tokens=4)
    tp1, tp2 = run_on_ranks(path, job, tp=1), run_on_ranks(path, job, tp=2)
    assert tp2["tokens"] == tp1["tokens"]
    assert torch.equal(tp2["logits"], tp1["logits"])
