"""W4A16 weights (kernels/quant/w4a16.py): the packed layout bit by bit, round-trip error bounds, exact shard cuts."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import quantize
from kernels.quant.w4a16 import pack, unpack


def test_pack_layout_nibble_i_of_word_j_is_column_8j_plus_i():
    q = torch.randint(-8, 8, (3, 32), generator=torch.Generator().manual_seed(0))
    words = pack(q)
    assert words.dtype == torch.int32 and tuple(words.shape) == (3, 4)
    for n in range(3):
        for j in range(4):
            word = int(words[n, j]) & 0xFFFFFFFF
            assert [((word >> (4 * i)) & 0xF) - 8 for i in range(8)] == q[n, 8 * j : 8 * j + 8].tolist()
    assert torch.equal(unpack(words).long(), q)


def test_every_value_survives_pack_unpack():
    q = torch.arange(-8, 8).repeat(2, 4)  # [2, 64]: each value at each nibble position
    assert torch.equal(unpack(pack(q)).long(), q)


@pytest.mark.parametrize("group", [128, 32])
def test_round_trip_error_at_most_half_a_step(group):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 1, 256)
    q = quantize(w, "w4a16", block=group)
    scale = q.tensors["weight_scale"]
    assert scale.dtype == torch.float16 and tuple(scale.shape) == (64, 256 // group)
    step = scale.float().repeat_interleave(group, 1)
    err = (q.dequantize() - w).abs()
    assert (err <= step * 0.5 * (1 + 1e-3)).all(), f"max error {(err / step).max():.4f} steps"


@pytest.mark.parametrize("dim", [0, 1])
def test_cut_equals_cut_of_dequantized(dim):
    q = quantize(torch.randn(96, 256), "w4a16", block=64)
    full = q.dequantize()
    for part in (slice(0, 64), slice(64, 192)):
        got = q.cut(dim, part).dequantize()
        assert torch.equal(got, full[part] if dim == 0 else full[:, part])
    with pytest.raises(ValueError, match="tiles of 64"):
        q.cut(1, slice(32, 96))


def test_input_dim_must_be_whole_groups():
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        quantize(torch.randn(8, 200), "w4a16", block=128)
