"""The weight loader on quantized checkpoints: packed and dense views of the same shards, exllamav3's fused KDA
tensors, and clear errors for a split off the tile grid or an unknown quantization method."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kernels.quant import QuantizedWeight
from model.config import ModelConfig
from model.model import Glm5Model
from model.parallel import Sharding
from model.quantize.convert import quantize_checkpoint
from model.quantize.select import Recipe
from model.weights import WeightReader
from tests.model.quant_helpers import QUANT_BLOCK, prompt_logits, read_tensors
from tests.model.reference import random_ids

TEXT = "model.language_model."
EXPERT = TEXT + "layers.1.mlp.experts.3.down_proj.weight"  # split along its input dim
ATTN = TEXT + "layers.0.self_attn.q_proj.weight"  # split along its output dim


def _reader(path: Path, rank: int = 0, world: int = 1) -> WeightReader:
    return WeightReader(path, Sharding(rank=rank, world=world), torch.float32, torch.device("cpu"), progress=False)


@pytest.mark.parametrize("ckpt, fmt, dtype", [("tiny_fp8", "fp8", torch.float8_e4m3fn),
                                              ("tiny_w4a16", "w4a16", torch.int32), ("tiny_int3", "int", torch.int32)])
def test_packed_and_dense_views_agree(ckpt, fmt, dtype, request):
    reader = _reader(request.getfixturevalue(ckpt))
    for key, dim in ((EXPERT, 1), (ATTN, 0)):
        assert reader.is_quantized(key)
        packed, dense = reader.split_packed(key, dim), reader.split(key, dim)
        assert len(packed) == len(dense) == 4
        for p, d in zip(packed, dense):
            assert isinstance(p, QuantizedWeight) and p.format == fmt
            assert next(iter(p.tensors.values())).dtype == dtype
            assert p.shape == tuple(d.shape) and torch.equal(p.dequantize(), d)
        whole = reader.full_packed(key)
        assert torch.equal(torch.cat([d for d in dense], dim), whole.dequantize())
    norm = TEXT + "layers.0.input_layernorm.weight"
    assert not reader.is_quantized(norm) and isinstance(reader.full_packed(norm), torch.Tensor)


def test_rank_reads_only_its_virtual_shards(tiny_w4a16):
    both = _reader(tiny_w4a16).split_packed(EXPERT, 1)
    rank1 = _reader(tiny_w4a16, rank=1, world=2).split_packed(EXPERT, 1)
    assert [p.shape for p in rank1] == [(64, 8)] * 2
    for mine, ref in zip(rank1, both[2:]):
        assert all(torch.equal(mine.tensors[n], ref.tensors[n]) for n in ref.tensors)


def test_split_off_the_block_grid_is_refused(tiny_default, tmp_path):
    # fp8 blocks of 16, planned for one virtual shard (so the experts are packed), loaded at the default 4: an
    # expert's 32 intermediate channels cut into 4 virtual shards of 8 split every block.
    quantize_checkpoint(tiny_default, tmp_path / "fp8_16", Recipe("fp8", "fp8", block=16, virtual=1), progress=False)
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj: fp8 stores output rows in tiles of 16.*\[0:8\)"):
        Glm5Model.load(tmp_path / "fp8_16", progress=False)


def test_unknown_quant_method_is_refused(tiny_default, tmp_path):
    shutil.copytree(tiny_default, tmp_path / "gptq")
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'gptq' is not supported.*exl3, fp8, twinspark_int, twinspark_w4a16"):
        _reader(tmp_path / "gptq")


def _fuse_kda(src: Path, dst: Path) -> Path:
    """src with every KDA layer's q/k/v projections and short convs stored fused, as exllamav3 writes them
    (`self_attn.qkv_proj.weight`, `self_attn.conv1d.weight`: q, k, v rows in that order)."""
    tensors = read_tensors(src)
    for layer in ModelConfig.from_pretrained(src).kda_layers:
        p = f"{TEXT}layers.{layer}.self_attn."
        for parts, fused in (("{}_proj", "qkv_proj"), ("{}_conv1d", "conv1d")):
            tensors[p + fused + ".weight"] = torch.cat([tensors.pop(p + parts.format(x) + ".weight") for x in "qkv"])
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    return dst


def test_exllamav3_fused_kda_tensors_read_as_thirds(tiny_default, tmp_path):
    fused = _fuse_kda(tiny_default, tmp_path / "fused")
    ids = random_ids(40, seed=9)
    want = prompt_logits(Glm5Model.load(tiny_default, progress=False), ids)
    assert torch.equal(prompt_logits(Glm5Model.load(fused, progress=False), ids), want)
    # quantized fused: W4A16 rows are independent, so the fused and split checkpoints quantize to the same values
    quantize_checkpoint(fused, tmp_path / "fused_w4", Recipe("w4a16", "w4a16", block=QUANT_BLOCK), progress=False)
    quantize_checkpoint(tiny_default, tmp_path / "w4", Recipe("w4a16", "w4a16", block=QUANT_BLOCK), progress=False)
    reader = _reader(tmp_path / "fused_w4")
    assert reader.is_quantized(TEXT + "layers.0.self_attn.k_proj.weight")
    got = prompt_logits(Glm5Model.load(tmp_path / "fused_w4", progress=False), ids)
    assert torch.equal(got, prompt_logits(Glm5Model.load(tmp_path / "w4", progress=False), ids))
