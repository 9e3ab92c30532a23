"""EXL3 decode (kernels/quant/exl3.py) against independent re-statements of exllamav3 1.6.5's format:

- the bit stream, packed here from trellis symbols the way `exllamav3_ext/quant/pack.cu` packs them (MSB first,
  16-bit words swapped in pairs), written with Python bit lists instead of word arithmetic;
- the codebooks' spread against exllamav3's own constant (`exl3_lib/quantize.py`: codebook_scale = 1.24371088, the
  standard deviation its 3INST / MCG codebooks decode random states to);
- the Hadamard rotation against the explicit 128x128 Sylvester matrix and the dense formula of
  `LinearEXL3.get_weight_tensor` in float64.
"""

from __future__ import annotations

import pytest
import torch

from kernels.quant import QuantizedWeight
from kernels.quant import exl3

EXLLAMAV3_CODEBOOK_SCALE = 1.24371088


def _pack_reference(symbols: list[list[int]], bits: float) -> tuple[torch.Tensor, list[list[int]]]:
    """Tiles of 256 symbols -> (int16 trellis [tiles, 16K], each step's expected 16-bit state)."""
    ka = int(bits)
    widths = [ka + (bits != ka and j % 2) for j in range(256)]
    packed, states = [], []
    for tile in symbols:
        stream = [b for v, w in zip(tile, widths) for b in ((v >> (w - 1 - i)) & 1 for i in range(w))]
        words = [int("".join(map(str, stream[16 * m : 16 * m + 16])), 2) for m in range(len(stream) // 16)]
        swapped = [words[m ^ 1] for m in range(len(words))]  # SWAP16 of each 32-bit pair
        packed.append([w - 65536 if w >= 32768 else w for w in swapped])
        ends, total, pos = [], len(stream), 0
        for w in widths:
            pos += w
            ends.append(pos)
        states.append([int("".join(str(stream[(e - 16 + i) % total]) for i in range(16)), 2) for e in ends])
    return torch.tensor(packed, dtype=torch.int16), states


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8, 2.5])
def test_unpacked_states_are_the_stream_windows(bits):
    g = torch.Generator().manual_seed(int(bits * 10))
    widths = [int(bits) + (bits != int(bits) and j % 2) for j in range(256)]
    symbols = [[int(torch.randint(0, 1 << w, (), generator=g)) for w in widths] for _ in range(3)]
    trellis, states = _pack_reference(symbols, bits)
    assert trellis.shape[-1] == 16 * bits
    assert exl3.unpack_states(trellis).tolist() == states


def test_tile_order_is_the_tensor_core_fragment_permutation():
    order = exl3.TILE_ORDER.tolist()
    assert sorted(order) == list(range(256))
    # lane 0: rows 0, 1, 8, 9 of columns 0 and 8; lane 1 starts at row 2; lane 4 at column 1
    assert order[:8] == [0, 16, 128, 144, 8, 24, 136, 152]
    assert order[8] == 2 * 16 and order[32] == 1


@pytest.mark.parametrize("name, rel", [("3inst", 2e-5), ("mcg", 1e-3)])
def test_3inst_and_mcg_spread_is_exllamav3s_codebook_scale(name, rel):
    # The constant matches 3INST to 6 digits (it was measured on that codebook); MCG, a later codebook sharing the
    # same scale, spreads 3e-4 wider.
    assert exl3.codebook_std(name) == pytest.approx(EXLLAMAV3_CODEBOOK_SCALE, rel=rel)


def test_mul1_codebook_is_a_unit_spread_byte_sum():
    v = exl3.codebook("mul1").float()
    assert exl3.codebook_std("mul1") == pytest.approx(1.0, abs=2e-3)
    # the byte sum of a 32-bit product is 0..1020, mapped to (1024 + s) * 0.00677 - 10.39: about -3.46 .. 3.45
    assert -3.5 < v.min().item() < -3.4 and 3.3 < v.max().item() < 3.5
    assert exl3.codebook("mul1")[0].item() == pytest.approx(1024 * 0.006767 - 10.3828, abs=2e-3)


def _sylvester() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h


def test_fwht_is_the_sylvester_matrix_per_128_block():
    x = torch.randn(3, 256, dtype=torch.float64)
    h = _sylvester()
    want = torch.cat([x[:, :128] @ h.T, x[:, 128:] @ h.T], 1)
    assert torch.allclose(exl3.fwht(x), want, atol=1e-12)


@pytest.mark.parametrize("codebook", ["mul1", "mcg", "3inst"])
def test_dequantize_is_exllamav3s_weight_formula(codebook):
    t = exl3.random_linear(256, 384, std=0.02, bits=3, codebook_name=codebook,
                           generator=torch.Generator().manual_seed(3))
    q = QuantizedWeight.from_tensors("exl3", t)
    assert q.shape == (256, 384) and q.params == {"bits": 3, "codebook": codebook}
    # get_weight_tensor: w [in, out] = decoded tiles; had_l (rows, 128 blocks); * suh; had_r (cols); * svh; then ours
    # is its transpose. In float64 with explicit matrices:
    inner = exl3.decode_tiles(t["trellis"], codebook).double()
    h = _sylvester() / 128**0.5
    w = torch.block_diag(*[h] * 3) @ inner * t["suh"].double().unsqueeze(1)
    w = w @ torch.block_diag(*[h] * 2) * t["svh"].double().unsqueeze(0)
    got = q.dequantize()
    assert torch.allclose(got.double(), w.T, rtol=1e-5, atol=1e-7)
    assert got.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("dim", [0, 1])
def test_cut_on_hadamard_blocks_equals_cut_of_dequantized(dim):
    q = QuantizedWeight.from_tensors("exl3", exl3.random_linear(384, 256, std=0.1, bits=4,
                                                                generator=torch.Generator().manual_seed(4)))
    full = q.dequantize()
    part = slice(128, 256)
    assert torch.equal(q.cut(dim, part).dequantize(), full[part] if dim == 0 else full[:, part])
    # 16-wide trellis tiles are not enough: a Hadamard block's outputs each depend on all 128 of its rows
    with pytest.raises(ValueError, match="tiles of 128"):
        q.cut(dim, slice(16, 144))


def test_random_linear_writes_exllamav3s_tensors():
    t = exl3.random_linear(128, 256, std=1.0, bits=2.5, codebook_name="mul1")
    assert t["trellis"].dtype == torch.int16 and tuple(t["trellis"].shape) == (16, 8, 40)
    assert t["suh"].dtype == t["svh"].dtype == torch.float16
    assert t["mul1"].dtype == torch.int32 and t["mul1"].dim() == 0
    assert int(t["mul1"]) & 0xFFFFFFFF == 0x83DCD12D
    with pytest.raises(ValueError, match="mul1 codebook"):
        exl3.random_linear(128, 128, std=1.0, bits=2.5, codebook_name="mcg")
    with pytest.raises(ValueError, match="multiples of 128"):
        exl3.random_linear(64, 128, std=1.0)
