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


# post_pre: D a multiple of the projection's 256-wide chunk (one chunk in each stream; 1,280: post's 1,024-wide
# blocks and a partial one), and 96 (not a multiple: the two calls).
BOUNDARY_D = (256, 1280, 96)


def boundary(t: int, d: int, seed: int, dtype: torch.dtype = HALF, shards: int = 3) -> dict[str, torch.Tensor]:
    """A block boundary's inputs: the block's partials, the streams, its post and comb, and the next block's mHC."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g).to(DEVICE)  # noqa: E731
    return dict(partials=randn(shards, t, d, dtype=torch.float32, seed=seed), residual=randn(t, HC, d, dtype=dtype,
                seed=seed + 1), post_w=2 * rand(t, HC), comb=rand(t, HC, HC),
                fn=randn(HC * (2 + HC), HC * d, dtype=dtype, seed=seed + 2, scale=0.05),
                base=randn(HC * (2 + HC), dtype=torch.float32, seed=seed + 3, scale=0.1),
                scale=randn(3, dtype=torch.float32, seed=seed + 4, scale=0.1) + 1,
                norm=1 + randn(d, dtype=dtype, seed=seed + 5, scale=0.1))


def rows(b: dict[str, torch.Tensor], picked: slice | list[int]) -> dict[str, torch.Tensor]:
    """The boundary's inputs of some rows (the weights as they are)."""
    out = dict(b, residual=b["residual"][picked], post_w=b["post_w"][picked], comb=b["comb"][picked])
    out["partials"] = b["partials"][:, picked].contiguous()
    return out


def unfused(b: dict[str, torch.Tensor], decode_rows: int) -> tuple[torch.Tensor, ...]:
    streams = mhc.post(b["partials"], b["residual"], b["post_w"], b["comb"])
    return streams, *mhc.pre(streams, b["fn"], b["base"], b["scale"], b["norm"],
                             **{**GPU_KW, "decode_rows": decode_rows})


def fused(b: dict[str, torch.Tensor], decode_rows: int) -> tuple[torch.Tensor, ...]:
    return mhc.post_pre(b["partials"], b["residual"], b["post_w"], b["comb"], b["fn"], b["base"], b["scale"],
                        b["norm"], **{**GPU_KW, "decode_rows": decode_rows})


@pytest.mark.parametrize("dtype", [HALF, torch.float32], ids=["half", "fp32"])
@pytest.mark.parametrize("d", BOUNDARY_D[:2])
def test_post_projection_equals_post_then_projection(d: int, dtype: torch.dtype) -> None:
    """The fused launch's new streams are post's and its chunk partials _proj_kernel's on them, bit for bit (37
    rows: three 16-row tiles, the last one partial)."""
    b = boundary(37, d, seed=20, dtype=dtype)
    streams = torch.empty_like(b["residual"])
    ws = mhc._post_project(b["partials"], b["residual"], b["post_w"], b["comb"], b["fn"], streams)
    want = mhc.post(b["partials"], b["residual"], b["post_w"], b["comb"])
    assert torch.equal(streams, want)
    assert torch.equal(ws, mhc._project(want, b["fn"]))


@pytest.mark.parametrize("decode_rows", CLASSES.values(), ids=CLASSES.keys())
@pytest.mark.parametrize("d", BOUNDARY_D)
def test_post_pre_equals_post_then_pre(d: int, decode_rows: int) -> None:
    b = boundary(T, d, seed=30)
    assert all(torch.equal(f, u) for f, u in zip(fused(b, decode_rows), unfused(b, decode_rows), strict=True))


@pytest.mark.parametrize("d", BOUNDARY_D[:2])
def test_post_pre_row_alone_equals_row_in_company(d: int) -> None:
    """A decode row's boundary alone and among 2..40 rows (in other 16-row tiles, at other places in its own)."""
    b = boundary(41, d, seed=40)
    alone = fused(rows(b, [20]), CLASSES["decode"])
    for n in (2, 16, 17, 41):
        picked = list(range(n)) if n > 20 else [*range(n - 1), 20]
        at = picked.index(20)
        together = fused(rows(b, picked), CLASSES["decode"])
        assert all(torch.equal(a[0], t[at]) for a, t in zip(alone, together, strict=True)), n


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
