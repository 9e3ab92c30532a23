"""twinspark's EXL3 encoder (kernels/quant/exl3_encode.py): the words it packs decode (exl3.py) to the states its
search scored, each tile's path closes its circle, the error at each rate is what a trellis coder should reach, and
the output depends only on the weight and the seed."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import QuantizedWeight, exl3, quantize
from kernels.quant import exl3_encode as enc

RATES = [1, 2, 2.5, 3, 3.5, 4, 6, 8]


@pytest.mark.parametrize("bits", RATES)
def test_pack_steps_is_the_inverse_of_unpack_states(bits):
    k = exl3.step_bits(bits)
    g = torch.Generator().manual_seed(int(bits * 2))
    values = torch.stack([torch.randint(0, 1 << int(kk), (7,), generator=g) for kk in k], dim=-1)
    trellis = exl3.pack_steps(values, bits)
    assert trellis.dtype == torch.int16 and trellis.shape == (7, 16 * bits)
    states = exl3.unpack_states(trellis)
    assert torch.equal(states & ((1 << k) - 1), values)  # each step's low bits are the bits it added
    assert torch.equal(((states.roll(1, -1) << k) | values) & 0xFFFF, states)  # the circle, step 0 included


@pytest.mark.parametrize("bits, codebook", [(1, "3inst"), (2, "mul1"), (2.5, "mul1"), (3, "3inst"), (3.5, "mul1"),
                                           (4, "mcg"), (8, "mul1")])
def test_the_packed_path_decodes_to_the_error_the_search_scored(bits, codebook):
    cb = exl3.codebook(codebook).float()
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)) * cb.std()
    k = exl3.step_bits(bits).tolist()
    end, _, _ = enc._search(x, cb, k, 8, wrap=None)
    wrap = end & ((1 << (16 - k[0])) - 1)
    _, values, cost = enc._search(x, cb, k, 8, wrap=wrap)
    states = exl3.unpack_states(exl3.pack_steps(values, bits))
    assert torch.equal(states[:, 0] >> k[0], wrap)  # the first state starts with the wrap bits pass 1 chose
    assert torch.allclose((cb[states] - x).square().sum(1), cost, rtol=1e-5)


# Normalised MSE on unit Gaussian tiles at beam 32 (measured 0.093, 0.054, 0.026, 0.0076): bounds with headroom. An
# exact Viterbi search (exllamav3's) reaches about 0.07 / 0.018 / 0.005 at 2 / 3 / 4 bits.
@pytest.mark.parametrize("bits, bound", [(2, 0.11), (2.5, 0.065), (3, 0.032), (4, 0.0095)])
def test_error_at_each_rate(bits, bound):
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    w[:, 5] *= 8  # an outlier input channel: the rotation spreads it
    q = quantize(w, "exl3", bits=bits, generator=torch.Generator().manual_seed(2))
    assert q.shape == (256, 128) and q.tensors["trellis"].shape == (8, 16, 16 * bits)
    nmse = ((q.dequantize() - w).square().sum() / w.square().sum()).item()
    assert nmse < bound


@pytest.mark.parametrize("codebook", ["mul1", "mcg", "3inst"])
def test_the_tensors_are_exllamav3s_and_cut_like_any_exl3_weight(codebook):
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)) * 0.05
    q = quantize(w, "exl3", bits=3, codebook=codebook, generator=torch.Generator().manual_seed(5))
    t = q.tensors
    assert {n for n in t} == {"trellis", "suh", "svh", *exl3.marker(codebook)}
    assert t["suh"].dtype == t["svh"].dtype == torch.float16 and t["suh"].shape == (256,)
    assert q.params == {"bits": 3, "codebook": codebook}
    assert torch.equal(q.cut(1, slice(128, 256)).dequantize(), q.dequantize()[:, 128:256])


def test_same_seed_same_words_whatever_the_threads():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(6))
    runs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            runs.append(quantize(w, "exl3", bits=2.5, generator=torch.Generator().manual_seed(7)).tensors)
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    other = quantize(w, "exl3", bits=2.5, generator=torch.Generator().manual_seed(8)).tensors
    assert not torch.equal(other["suh"], runs[0]["suh"])


def test_the_words_do_not_depend_on_the_chunk_the_tiles_are_searched_in(monkeypatch):
    """The GPU searches 16x more tiles at once than the CPU (exl3_encode.GPU_CHUNK): a tile's path must be the
    same whichever tiles share its chunk."""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(9))
    runs = []
    for chunk in (128, 5):  # every tile in one chunk; uneven chunks of 5
        monkeypatch.setattr(enc, "CHUNK", chunk)
        runs.append(quantize(w, "exl3", bits=3, generator=torch.Generator().manual_seed(10)).tensors)
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_bad_shapes_and_rates_are_refused():
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize(torch.zeros(64, 128), "exl3")
    with pytest.raises(ValueError, match="1.5 / 2.5 / 3.5 with the mul1 codebook"):
        quantize(torch.zeros(128, 128), "exl3", bits=2.5, codebook="mcg")


def test_an_all_zero_weight_encodes():
    q = quantize(torch.zeros(128, 128), "exl3", bits=2)
    assert isinstance(q, QuantizedWeight) and q.dequantize().abs().max() < 1e-3
