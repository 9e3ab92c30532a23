"""The int formats (kernels/quant/intn.py, bitstream.py): the packed bit stream worked out by hand and against a
big-integer stream, W4A16's packing at 4 bits, signed scales and the round-trip error bound, exact shard cuts, the
shape rules, random draws, and telling int from W4A16 by the scales' dtype."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import QuantizedWeight, codec_of, quantize, random_quantized
from kernels.quant import bitstream, intn, w4a16

BITS = (2, 3, 4, 8)


def test_a_3_bit_row_by_hand():
    # 32 codes in 3 words; element i in stream bits [3i, 3i + 3), lowest first. Element 1 = 0b011 sits at bits 3..5
    # of word 0; element 10 = 0b111 at bits 30..32, so bits 30-31 of word 0 and bit 0 of word 1; element 21 = 0b101
    # at bits 63..65: bit 31 of word 1 (its low bit, 1), bits 0-1 of word 2 (0, then 1); element 31 = 0b110 at bits
    # 93..95 = bits 29..31 of word 2 (0, 1, 1).
    codes = torch.zeros(1, 32, dtype=torch.int64)
    codes[0, [1, 10, 21, 31]] = torch.tensor([0b011, 0b111, 0b101, 0b110])
    words = bitstream.pack(codes, 3)
    assert words.dtype == torch.int32 and words.shape == (1, 3)
    assert [w & 0xFFFFFFFF for w in words[0].tolist()] == [0xC0000018, 0x80000001, 0xC0000002]
    assert torch.equal(bitstream.unpack(words, 3), codes)


@pytest.mark.parametrize("bits", BITS)
def test_pack_is_one_little_endian_stream_per_row(bits):
    n = 2 * bitstream.period(bits)[0]
    codes = (torch.arange(5).unsqueeze(1) + torch.arange(n) * 7) % (1 << bits)  # every code at many positions
    words = bitstream.pack(codes, bits)
    assert words.shape == (5, n * bits // 32)
    for row, got in zip(codes.tolist(), words.tolist()):
        stream = sum(c << (i * bits) for i, c in enumerate(row))  # the row's bits as one big integer
        assert [w & 0xFFFFFFFF for w in got] == [(stream >> (32 * j)) & 0xFFFFFFFF for j in range(len(got))]
    assert torch.equal(bitstream.unpack(words, bits), codes)


def test_4_bits_is_w4a16s_packing():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    int4 = quantize(w, "int", bits=4, block=32)
    q = bitstream.unpack(int4.tensors["weight_packed"], 4) - 8
    # W4A16's rule (w4a16.py): word j holds columns 8j..8j+7 as nibbles q + 8, lowest first
    want = [[sum((q[n, 8 * j + i].item() + 8) << (4 * i) for i in range(8)) for j in range(8)] for n in range(4)]
    assert [[word & 0xFFFFFFFF for word in row] for row in int4.tensors["weight_packed"].tolist()] == want
    assert torch.equal(w4a16.pack(q), int4.tensors["weight_packed"])


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_and_the_extreme_element(bits):
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(2)) * torch.logspace(-2, 1, 256)).bfloat16()
    w = w.float()  # bfloat16 values, as a checkpoint stores them: the extreme element's scale is then exact
    q = quantize(w, "int", bits=bits, block=64)
    scale = q.tensors["weight_scale"]
    assert scale.dtype == torch.bfloat16 and scale.shape == (64, 4) and q.params == {"bits": bits, "group": 64}
    step = scale.float().abs().repeat_interleave(64, 1)
    err = (q.dequantize() - w).abs()
    qmin, qmax = intn.levels(bits)
    inside = w / scale.float().repeat_interleave(64, 1) <= qmax + 0.5
    assert (err[inside] <= step[inside] / 2).all()
    assert (err[~inside] <= step[~inside]).all()  # past the top level, clamped: the half level a signed scale gives up
    codes = bitstream.unpack(q.tensors["weight_packed"], bits).view(64, 4, 64) + qmin
    extreme = w.view(64, 4, 64).abs().argmax(-1, keepdim=True)
    # each group's extreme element is the bottom level, and comes back exactly
    assert (codes.gather(-1, extreme) == qmin).all()
    assert torch.equal(q.dequantize().view(64, 4, 64).gather(-1, extreme), w.view(64, 4, 64).gather(-1, extreme))


def test_the_scale_is_signed_the_first_extreme_wins_and_zeros_get_one():
    w = torch.zeros(3, 32)
    w[0, :3] = torch.tensor([0.5, -1.0, 0.25])  # extreme -1: scale +1/8, so -1 -> -8 and 0.5 -> 4
    w[1, :2] = torch.tensor([1.0, -1.0])  # a tie: the first (+1) sets scale -1/8; -1 -> +8, clamped to 7
    q = quantize(w, "int", bits=4, block=32)
    assert q.tensors["weight_scale"].float().flatten().tolist() == [0.125, -0.125, 1.0]
    d = q.dequantize()
    assert d[0, :3].tolist() == [0.5, -1.0, 0.25] and d[1, :2].tolist() == [1.0, -0.875] and not d[2].any()


@pytest.mark.parametrize("bits", BITS)
def test_shards_cut_on_the_group_grid_are_exact(bits):
    q = quantize(torch.randn(128, 256, generator=torch.Generator().manual_seed(3)), "int", bits=bits, block=64)
    for dim in (0, 1):  # every 64-wide shard of each dim, dequantized on its own, put back together
        shards = [q.cut(dim, slice(i, i + 64)).dequantize() for i in range(0, q.shape[dim], 64)]
        assert torch.equal(torch.cat(shards, dim), q.dequantize())
    with pytest.raises(ValueError, match="tiles of 64"):
        q.cut(1, slice(32, 96))


def test_shapes_off_the_rules_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize(torch.randn(8, 200), "int", bits=4, block=32)
    with pytest.raises(ValueError, match="group size times the bits must be a multiple of 32"):
        quantize(torch.randn(8, 96), "int", bits=3, block=16)
    with pytest.raises(ValueError, match="the int formats have 2, 3, 4, 8"):
        quantize(torch.randn(8, 96), "int", bits=5, block=32)
    tensors = {"weight_packed": torch.zeros(4, 5, dtype=torch.int32), "weight_scale": torch.ones(4, 2)}
    with pytest.raises(ValueError, match=r"no int format: the scales must be \[out, in / 32\]"):
        QuantizedWeight.from_tensors("int", tensors, {"group_size": 32})
    with pytest.raises(ValueError, match="no group size"):
        QuantizedWeight.from_tensors("int", tensors)


@pytest.mark.parametrize("bits", BITS)
def test_random_linear_has_the_asked_std_and_uniform_codes(bits):
    q = random_quantized("int", 256, 1024, std=0.02, bits=bits, block=128,
                         generator=torch.Generator().manual_seed(4))
    assert q.params == {"bits": bits, "group": 128} and q.tensors["weight_packed"].shape == (256, 32 * bits)
    assert abs(q.dequantize().std().item() / 0.02 - 1) < 0.05
    codes = bitstream.unpack(q.tensors["weight_packed"], bits).float()
    assert abs(codes.mean().item() / ((1 << bits) - 1) * 2 - 1) < 0.02


def test_int_and_w4a16_store_the_same_names_and_differ_in_the_scales_dtype():
    names = {"weight_packed": "x.weight_packed", "weight_scale": "x.weight_scale"}
    dtypes = {"x.weight_packed": torch.int32, "x.weight_scale": torch.bfloat16}
    assert codec_of(names, dtypes.__getitem__) is intn.CODEC
    dtypes["x.weight_scale"] = torch.float16
    assert codec_of(names, dtypes.__getitem__) is w4a16.CODEC
