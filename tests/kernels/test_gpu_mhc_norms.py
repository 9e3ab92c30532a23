"""GPU mHC (kernels/gpu/mhc.py) and row-wise norms (kernels/gpu/norms.py) against their torch twins, and their row
invariance."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, HALF_TOL, randn

from kernels import mhc as ref  # noqa: E402
from kernels.gpu import mhc, norms  # noqa: E402
from kernels.norms import layer_norm, rms_norm  # noqa: E402

T, HC, D = 9, 4, 96
KW = dict(eps=1e-6, norm_eps=1e-5, iters=20)
GPU_KW = dict(rms_eps=1e-5, decode_rows=1 << 30, **KW)
# decode_rows: every row decode-class (split-K projection + one program per row), every row a prompt row (the GEMM
# + the same row pass), or both classes in one call.
CLASSES = {"decode": 1 << 30, "prefill": 0, "mixed": 5}


def params() -> dict[str, torch.Tensor]:
    return dict(fn=randn(HC * (2 + HC), HC * D, seed=1, scale=0.05),
                base=randn(HC * (2 + HC), dtype=torch.float32, seed=2, scale=0.1),
                scale=randn(3, dtype=torch.float32, seed=3, scale=0.1) + 1,
                norm=1 + randn(D, seed=4, scale=0.1))


def twin_pre(streams, p):
    c = lambda t: t.cpu()  # noqa: E731
    pre, post, comb = ref.hc_weights(c(streams).float(), c(p["fn"]), c(p["base"]), c(p["scale"]), **KW)
    h = rms_norm(ref.collapse(c(streams), pre), c(p["norm"]), 1e-5)
    return h, post, comb


def gpu_pre(streams: torch.Tensor, p: dict[str, torch.Tensor], decode_rows: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return mhc.pre(streams, p["fn"], p["base"], p["scale"], p["norm"], **{**GPU_KW, "decode_rows": decode_rows})


@pytest.mark.parametrize("decode_rows", CLASSES.values(), ids=CLASSES.keys())
def test_pre_matches_twin(decode_rows: int) -> None:
    streams, p = randn(T, HC, D, seed=5), params()
    h, post, comb = gpu_pre(streams, p, decode_rows)
    want_h, want_post, want_comb = twin_pre(streams, p)
    torch.testing.assert_close(post.cpu(), want_post, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comb.cpu(), want_comb, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h.cpu().float(), want_h.float(), rtol=1e-2, atol=1e-2)


def test_post_matches_twin() -> None:
    residual, partials = randn(T, HC, D, seed=6), randn(3, T, D, dtype=torch.float32, seed=7)
    post_w, comb = torch.rand(T, HC, device=DEVICE), torch.rand(T, HC, HC, device=DEVICE)
    out = mhc.post(partials, residual, post_w, comb)
    block_out = (partials[0] + partials[1] + partials[2]).to(HALF)
    want = ref.expand(block_out.cpu(), residual.cpu(), post_w.cpu(), comb.cpu())
    torch.testing.assert_close(out.cpu().float(), want.float(), **HALF_TOL)


def test_norms_match_twin() -> None:
    x, w, b = randn(T, D, seed=8), 1 + randn(D, seed=9, scale=0.1), randn(D, seed=10, scale=0.1)
    torch.testing.assert_close(norms.rms_norm(x, w, 1e-5).cpu().float(), rms_norm(x.cpu(), w.cpu(), 1e-5).float(),
                               rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(norms.layer_norm(x, w, b, 1e-6).cpu().float(),
                               layer_norm(x.cpu().float(), w.cpu().float(), b.cpu().float(), 1e-6),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("decode_rows", [CLASSES["decode"], CLASSES["prefill"]], ids=["decode", "prefill"])
def test_rows_alone_equal_rows_in_company(decode_rows: int) -> None:
    # 37 rows: row 20 sits in the decode projection's second 16-row tile, alone it is row 0 of the first.
    streams, p = randn(37, HC, D, seed=11), params()
    alone = gpu_pre(streams[20:21], p, decode_rows)
    together = gpu_pre(streams, p, decode_rows)
    assert all(torch.equal(a[0], b[20]) for a, b in zip(alone, together))
    x, w = randn(T, D, seed=12), 1 + randn(D, seed=13, scale=0.1)
    assert torch.equal(norms.rms_norm(x[4:5], w, 1e-5)[0], norms.rms_norm(x, w, 1e-5)[4])


def test_mixed_rows_equal_each_class_alone() -> None:
    streams, p, n = randn(T, HC, D, seed=14), params(), CLASSES["mixed"]
    mixed = gpu_pre(streams, p, n)
    decode = gpu_pre(streams[:n], p, CLASSES["decode"])
    prompt = gpu_pre(streams[n:], p, CLASSES["prefill"])
    assert all(torch.equal(m[:n], a) and torch.equal(m[n:], b) for m, a, b in zip(mixed, decode, prompt))


def torch_hc_final(streams: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """FusedForward.hc_final as torch ops before its one launch: fp32 adds in stream order, / N, rounding, norm."""
    total = streams[:, 0].float()
    for i in range(1, streams.shape[1]):
        total = total + streams[:, i].float()
    return norms.rms_norm((total / streams.shape[1]).to(streams.dtype), w, eps)


# (streams, width): the tiny models' and the release's hidden size (8 warps a row there, as rms_norm takes). On a
# CPU torch divides by N where CUDA multiplies by its fp32 reciprocal (as the kernel does): equal for these N.
@pytest.mark.parametrize("n, d", [(4, D), (2, 100), (4, 4096)])
def test_mean_rms_norm_equals_torch_ops(n: int, d: int) -> None:
    streams = randn(T, n, d, seed=7)
    streams[2, 1, ::5] = -0.0
    w = 1 + randn(d, seed=8, scale=0.1)
    got = norms.mean_rms_norm(streams, w, 1e-5)
    assert torch.equal(got, torch_hc_final(streams, w, 1e-5))
    assert torch.equal(norms.mean_rms_norm(streams[3:4], w, 1e-5)[0], got[3])  # a row alone = among others
