"""`make-tiny --format int3` (and int2 / int4 / int8): the experts widened so every MLP linear is whole groups on 4
virtual shards, each linear the recipe packs stored as random int codes in compressed-tensors' names, the group
size in config.json, and the same bytes for the same seed."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.quant import QuantizedWeight
from model.checkpoint import make_tiny, write_tiny
from tests.model.quant_helpers import read_tensors

TEXT = "model.language_model."


@pytest.fixture(scope="module")
def made_int3(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("make_tiny_int") / "ckpt", format="int3", layers=2, experts=2)


def test_every_mlp_linear_is_int_codes_in_groups_of_32(made_int3):
    t = read_tensors(made_int3)
    cfg = json.loads((made_int3 / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "twinspark_int", "group_size": 32, "symmetric": True,
                                          "format": "pack-quantized",
                                          "pack": "int32 LSB-first bitstream of q + 2^(bits-1) along the input dim"}
    assert cfg["text_config"]["moe_intermediate_size"] == 128  # 4 virtual shards of one group each
    for key in (f"{TEXT}layers.0.mlp.down_proj", f"{TEXT}layers.1.mlp.experts.1.down_proj",
                f"{TEXT}layers.1.mlp.shared_experts.up_proj", f"{TEXT}layers.0.self_attn.q_proj"):
        packed, scale = t[f"{key}.weight_packed"], t[f"{key}.weight_scale"]
        assert packed.dtype == torch.int32 and scale.dtype == torch.bfloat16 and f"{key}.weight" not in t
        q = QuantizedWeight.from_tensors("int", {"weight_packed": packed, "weight_scale": scale}, {"group_size": 32})
        assert q.params == {"bits": 3, "group": 32} and q.shape[1] == 32 * scale.shape[1]
    # o_proj's 64 inputs are 16 per shard, less than a group of 32; the router and embeddings always stay dense
    for key in (f"{TEXT}layers.0.self_attn.o_proj", f"{TEXT}layers.1.mlp.gate", f"{TEXT}embed_tokens", "lm_head"):
        assert t[f"{key}.weight"].dtype == torch.bfloat16


def test_same_seed_same_bytes(made_int3, tmp_path):
    again = make_tiny(tmp_path / "again", format="int3", layers=2, experts=2)
    for f in sorted(made_int3.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name


def test_the_group_defaults_to_quantizes_choice_and_can_be_given(tmp_path):
    assert write_tiny(tmp_path / "int4", format="int4", layers=1, experts=2, progress=False).group == 16
    given = write_tiny(tmp_path / "g64", format="int2", int_group=64, layers=1, experts=2, progress=False)
    assert given.group == 64
    assert json.loads((given.path / "config.json").read_text())["quantization_config"]["group_size"] == 64
    with pytest.raises(ValueError, match="multiple of 32"):
        write_tiny(tmp_path / "x", format="int3", int_group=16, progress=False)
    assert not (tmp_path / "x").exists()
