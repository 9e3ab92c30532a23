"""FP8 e4m3 weights (kernels/quant/fp8.py): round-trip error bounds, exact shard cuts, tile-grid refusals."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import QuantizedWeight, quantize
from kernels.quant.fp8 import E4M3_MAX

# e4m3 keeps 3 fraction bits: a normal value is off by at most 2^-4 of itself after rounding to nearest; below the
# smallest normal (2^-6 of the scale unit) the spacing is 2^-9, so the error is at most 2^-10 of the scale.
REL, SUBNORMAL = 2.0**-4, 2.0**-10


def _bound(w: torch.Tensor, scale_per_elem: torch.Tensor) -> torch.Tensor:
    return torch.maximum(w.abs() * REL, scale_per_elem * SUBNORMAL) * (1 + 1e-6)


@pytest.mark.parametrize("shape", [(256, 384), (200, 136)])  # whole blocks; partial last blocks
def test_block_round_trip_error_bound(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, shape[1])
    q = quantize(w, "fp8", block=128)
    assert q.tensors["weight"].dtype == torch.float8_e4m3fn and q.tensors["weight_scale_inv"].dtype == torch.float32
    assert tuple(q.tensors["weight_scale_inv"].shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    scale = q.tensors["weight_scale_inv"].repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    err = (q.dequantize() - w).abs()
    assert (err <= _bound(w, scale)).all(), f"max excess {(err - _bound(w, scale)).max():.3e}"
    # Each block's largest magnitude maps to the top of the e4m3 range.
    assert q.tensors["weight"].float().abs().amax().item() == E4M3_MAX


def test_channel_round_trip_error_bound_and_zero_rows():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    w[3] = 0  # an all-zero row gets scale 1 and dequantizes to exact zeros
    q = quantize(w, "fp8", block=None)
    assert tuple(q.tensors["weight_scale"].shape) == (64, 1) and q.tensors["weight_scale"][3].item() == 1.0
    d = q.dequantize()
    assert torch.equal(d[3], torch.zeros(96))
    assert ((d - w).abs() <= _bound(w, q.tensors["weight_scale"].expand(-1, 96))).all()


@pytest.mark.parametrize("block", [128, None])
@pytest.mark.parametrize("dim", [0, 1])
def test_cut_equals_cut_of_dequantized(block, dim):
    w = torch.randn(256, 200, generator=torch.Generator().manual_seed(2))
    q = quantize(w, "fp8", block=block)
    full = q.dequantize()
    for part in (slice(0, 128), slice(128, w.shape[dim])):  # the last part ends on a partial block
        got = q.cut(dim, part).dequantize()
        assert torch.equal(got, full[part] if dim == 0 else full[:, part])


def test_cut_off_the_block_grid_is_refused():
    q = quantize(torch.randn(256, 256), "fp8", block=128)
    with pytest.raises(ValueError, match=r"fp8 stores output rows in tiles of 128.*\[64:128\)"):
        q.cut(0, slice(64, 128), "layers.0.mlp.up_proj")


def test_from_tensors_rejects_scales_that_do_not_fit():
    q = quantize(torch.randn(256, 256), "fp8", block=128)
    with pytest.raises(ValueError, match="do not cover"):
        QuantizedWeight.from_tensors("fp8", q.tensors, {"weight_block_size": [64, 64]})
