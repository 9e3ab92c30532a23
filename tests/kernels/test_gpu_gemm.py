"""The fixed-schedule GEMM (kernels/gpu/gemm.py) against torch, and its row invariance (docs/design.md §5.1)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, randn

from kernels.gpu import arch as gpu_arch, arrivals, gemm  # noqa: E402  (after the importorskip in gpu_support)

# decode_rows values that make every row decode-class, or every row a prompt row
CLASSES = {"decode": 1 << 30, "prefill": 0}


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
@pytest.mark.parametrize("m,n,k", [(1, 64, 512), (37, 200, 1024), (130, 96, 384)])
def test_matches_torch(rows: int, m: int, n: int, k: int) -> None:
    x, w = randn(m, k, seed=1), randn(n, k, seed=2)
    out = gemm.matmul(x, w, rows, out_dtype=torch.float32)
    assert out.shape == (m, n)
    torch.testing.assert_close(out.double(), reference(x, w), rtol=1e-3, atol=1e-3 * k ** 0.5)


def test_decode_schedule_splits_k_and_sums_in_order() -> None:
    tile = gemm.schedule(64, 4096, gemm.RowClass.DECODE)
    assert tile.split_k > 1  # one N tile: the decode schedule must spread K over programs
    x, w = randn(3, 4096, seed=3), randn(64, 4096, seed=4)
    out = gemm.matmul(x, w, CLASSES["decode"], out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference(x, w), rtol=1e-3, atol=0.1)


def test_narrow_prompt_products_split_k_by_shape_only() -> None:
    """mHC's 24-wide projection of the 16,384-wide streams: the prompt schedule's narrow tile splits K (a function
    of N and K, never of the rows), matches torch, and a row's bits are the same alone or among 130 others."""
    n, k = 24, 16384
    tile = gemm.schedule(n, k, gemm.RowClass.PREFILL)
    assert tile.split_k > 1 and tile.block_n < gemm.schedule(4096, k, gemm.RowClass.PREFILL).block_n
    crowd, w = randn(131, k, seed=13), randn(n, k, seed=14)
    out = gemm.matmul(crowd, w, CLASSES["prefill"], out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference(crowd, w), rtol=1e-3, atol=1e-3 * k ** 0.5)
    for i in (0, 70, 130):
        assert torch.equal(gemm.matmul(crowd[i : i + 1], w, CLASSES["prefill"], out_dtype=torch.float32)[0], out[i])


def test_split_k_leaves_its_counters_zero_and_writes_strided_outputs() -> None:
    """The last split of a tile adds the partials and resets the tile's arrival counter, so the next launch (or a
    CUDA graph's replay) starts from zero; a strided output view (a column run of a wider projection) is written
    in place with the same bits as a contiguous one."""
    n, k = 256, 4096
    assert gemm.schedule(n, k, gemm.RowClass.DECODE).split_k > 1
    x, w = randn(5, k, seed=7).unsqueeze(0), randn(n, k, seed=8).unsqueeze(0)
    first = gemm.bmm(x, w, CLASSES["decode"], torch.float32)
    assert int(arrivals._TABLES[first.device].abs().sum()) == 0
    wide = torch.full((1, 5, n + 64), -1.0, device=first.device)
    gemm.bmm(x, w, CLASSES["decode"], torch.float32, out=wide[:, :, 32 : 32 + n])
    assert torch.equal(wide[:, :, 32 : 32 + n], first)
    assert bool((wide[:, :, :32] == -1).all()) and bool((wide[:, :, 32 + n :] == -1).all())
    assert torch.equal(gemm.bmm(x, w, CLASSES["decode"], torch.float32), first)


def _weight(fmt: str, n: int, k: int, seed: int):
    """A [N, K] weight as the kernels read it: dense, fp8 (128-blocks), int4 (group 128) or int3 (group 128)."""
    from kernels.gpu import wtiles
    if fmt == "dense":
        return randn(n, k, seed=seed)
    w = randn(n, k, seed=seed, scale=0.05).float().cpu()
    if fmt == "int3":
        return _int3(w)[0]
    if fmt == "fp8":
        q, s = _fp8_block(w)
        return wtiles.quantized("fp8", {"weight": q.to(DEVICE), "weight_scale_inv": s.to(DEVICE)},
                                {"block": (128, 128)})
    words, s4, _ = _int4(w)
    return wtiles.quantized("w4a16", {"weight_packed": words.to(DEVICE), "weight_scale": s4.to(DEVICE)}, {"group": 128})


@pytest.mark.parametrize("arch", gpu_arch.ROWS, ids=lambda a: f"sm_{a}")
@pytest.mark.parametrize("fmt", ["dense", "fp8", "w4a16", "int3"])
@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_row_alone_equals_row_in_company(rows: int, fmt: str, arch: int) -> None:
    """On each architecture's table row (kernels/gpu/arch.py: GB10's prompt tile is 128 wide, Hopper's 256)."""
    k, n = 1024, 256
    w = _weight(fmt, n, k, seed=5)
    crowd = randn(150, k, seed=6)
    with gpu_arch.assume(arch):
        alone = gemm.matmul(crowd[77:78], w, rows, out_dtype=torch.float32)
        for m in (2, 17, 78, 150):
            together = gemm.matmul(crowd[:m] if m > 77 else torch.cat([crowd[77:78], crowd[:m - 1]]), w, rows,
                                   out_dtype=torch.float32)
            row = together[77] if m > 77 else together[0]
            assert torch.equal(row, alone[0]), f"{fmt}: row changed beside {m - 1} others"


def test_split_rows_use_each_class_schedule() -> None:
    x, w = randn(40, 512, seed=7), randn(96, 512, seed=8)
    mixed = gemm.matmul(x, w, 9, out_dtype=torch.float32)
    assert torch.equal(mixed[:9], gemm.matmul(x[:9], w, CLASSES["decode"], out_dtype=torch.float32))
    assert torch.equal(mixed[9:], gemm.matmul(x[9:], w, CLASSES["prefill"], out_dtype=torch.float32))
    mixed3 = gemm.bmm(torch.stack([x, x, x]), torch.stack([w, w, w]), 9, out_dtype=torch.float32)
    assert all(torch.equal(mixed3[i], mixed) for i in range(3))


def test_batched_strided_weights() -> None:
    """Per-head products with the weight stored K x N (MLA's absorbed W_uk): strides, not copies."""
    x = randn(4, 10, 64, seed=9)  # [heads, rows, K]
    w_kn = randn(4, 64, 48, seed=10)  # [heads, K, N]
    out = gemm.bmm(x, w_kn.transpose(1, 2), 4, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), x.double() @ w_kn.double(), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_stacked_shards_equal_one_product_per_shard(rows: int) -> None:
    """Virtual shards in one launch (the model's stacked [S, N, K] weights): column-parallel with the input
    broadcast (stride 0), row-parallel with each shard's own activations — every shard's output is its own
    product's, bit for bit (K = 2048 makes the decode schedule split K, so the split sums are covered too)."""
    s, t, n, k = 4, 5, 64, 2048
    assert rows == 0 or gemm.schedule(n, k, gemm.RowClass.DECODE).split_k > 1
    x = randn(t, k, seed=30)
    w = randn(s, n, k, seed=31)
    column = gemm.bmm(x.unsqueeze(0).expand(s, -1, -1), w, rows, out_dtype=torch.float32)
    xs = randn(s, t, k, seed=32)
    row = gemm.bmm(xs, w, rows, out_dtype=torch.float32)
    for j in range(s):
        assert torch.equal(column[j], gemm.matmul(x, w[j], rows, out_dtype=torch.float32)), f"column shard {j}"
        assert torch.equal(row[j], gemm.matmul(xs[j], w[j], rows, out_dtype=torch.float32)), f"row shard {j}"


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_grouped_inputs_equal_each_input_repeated(rows: int) -> None:
    """Two stacked linears of S shards each with an input of their own (KDA's f_b over f_a's output, g_b over g_a's):
    x [2, T, K] for a [2S, N, K] stack, here as strided halves of one [T, 2K] output (the model's view) — every
    shard's output is the bits of the same product with the input repeated per shard."""
    s, t, n, k = 2, 5, 256, 512
    joined = randn(t, 2 * k, seed=40)
    pair = joined.view(t, 2, k).transpose(0, 1)  # [2, T, K], strides (K, 2K, 1)
    w = randn(2 * s, n, k, seed=41)
    out = gemm.bmm(pair, w, rows, torch.float32)
    want = gemm.bmm(pair.repeat_interleave(s, dim=0).contiguous(), w, rows, torch.float32)
    assert out.shape == (2 * s, t, n) and torch.equal(out, want)
    with pytest.raises(ValueError, match="do not fit"):
        gemm.bmm(randn(3, t, k, seed=42), w, rows)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_swiglu_input_equals_the_swiglu_kernel_then_the_product(rows: int) -> None:
    """The down projection reading gate | up through the clamped SwiGLU as it loads them: the SwiGLU kernel's
    output through the same product (bit for bit in the interpreter; on a GPU within fp32 rounding, `_same`: the
    activation tile is built in registers instead of loaded), for dense and fp8 weights, per shard (row-parallel:
    each shard's own input); a row alone = in company, bit for bit everywhere. Values past the clamp limit are in
    the inputs."""
    from kernels.gpu import swiglu, wtiles
    s, t, i, n, limit = 2, 9, 512, 256, 3.0
    gate_up = randn(s, t, 2 * i, seed=43, scale=2.0)
    dense = randn(s, n, i, seed=44, scale=0.05)
    q8, s8 = zip(*(_fp8_block(dense[j].float().cpu()) for j in range(s)))
    fp8 = wtiles.quantized("fp8", {"weight": torch.stack(q8).to(DEVICE),
                                   "weight_scale_inv": torch.stack(s8).to(DEVICE)}, {"block": (128, 128)})
    h = swiglu.swiglu(gate_up[..., :i], gate_up[..., i:], limit)
    for w in (dense, fp8):
        fused = gemm.bmm(gate_up, w, rows, torch.float32, swiglu=limit)
        _same(fused, gemm.bmm(h, w, rows, torch.float32))
        assert torch.equal(gemm.bmm(gate_up[:, 4:5], w, rows, torch.float32, swiglu=limit), fused[:, 4:5])
    assert gemm.reads_swiglu(dense) and gemm.reads_swiglu(fp8)
    with pytest.raises(ValueError, match="gate | up"):
        gemm.bmm(h, dense, rows, swiglu=limit)


def test_output_dtype_follows_input_by_default() -> None:
    out = gemm.matmul(randn(2, 256, seed=11), randn(32, 256, seed=12), 0)
    assert out.dtype == HALF and out.device.type == DEVICE


def _fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] weight as e4m3 + one fp32 scale per block (the layout kernels/quant/fp8.py stores)."""
    n, k = w.shape
    s = w.float().abs().view(n // block, block, k // block, block).amax(dim=(1, 3)).clamp_min(1e-8) / 448
    q = (w.float() / s.repeat_interleave(block, 0).repeat_interleave(block, 1)).to(torch.float8_e4m3fn)
    return q, s


def _int4(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [N, K] weight as int32 words of 8 nibbles (q + 8, lowest first) + fp16 scales per group; and q."""
    n, k = w.shape
    s = (w.float().abs().view(n, k // group, group).amax(-1) / 7).clamp_min(1e-8).half()
    q = (w.float() / s.float().repeat_interleave(group, 1)).round().clamp(-8, 7).to(torch.int64)
    nib = (q + 8).view(n, k // 8, 8) << (torch.arange(8) * 4)
    words = nib.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32), s, q


def _int3(w: torch.Tensor, group: int = 128) -> tuple:
    """A [N, K] weight in the int format at 3 bits (kernels/quant/intn.py) as kernel WeightArgs, and the twin's
    dequantized weight in the activation dtype."""
    from kernels.gpu import wtiles
    from kernels.quant import intn
    t = intn.quantize(w, 3, group)
    params = {"bits": 3, "group": group}
    deq = intn.CODEC.dequantize(t, tuple(w.shape), params).to(HALF).to(DEVICE)
    return wtiles.quantized("int", {n: v.to(DEVICE) for n, v in t.items()}, params), deq


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit off the GPU (the interpreter), within fp32 rounding on it (see the test below)."""
    if DEVICE == "cuda":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_quantized_weights_equal_their_dequantized_twin(rows: int) -> None:
    """fp8 (block and channel scales), int4 and int3 weights: the same schedule over the dequantized tiles, so the product
    equals the dense GEMM of the twin's dequantized weight — bit for bit in Triton's interpreter; on a GPU within
    fp32 rounding, since the compiler may lower a dot whose weight tile was built in registers to other tensor-core
    instructions than one whose tile was loaded (seen on the H200 with the 16-row decode tile). Row invariance,
    the exactness that matters, is exact on both (test_row_alone_equals_row_in_company)."""
    from kernels.gpu import wtiles
    n, k = 256, 512
    w = randn(n, k, seed=20, scale=0.05).float().cpu()
    x = randn(33, k, seed=21)
    q8, s8 = _fp8_block(w)
    fp8 = wtiles.quantized("fp8", {"weight": q8.to(DEVICE), "weight_scale_inv": s8.to(DEVICE)},
                           {"block": (128, 128)})
    deq8 = (q8.float() * s8.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(HALF).to(DEVICE)
    _same(gemm.matmul(x, fp8, rows, torch.float32), gemm.matmul(x, deq8, rows, torch.float32))
    cs = (w.abs().amax(1, keepdim=True) / 448)
    qc = (w / cs).to(torch.float8_e4m3fn)
    chan = wtiles.quantized("fp8", {"weight": qc.to(DEVICE), "weight_scale": cs.to(DEVICE)}, {"block": None})
    _same(gemm.matmul(x, chan, rows, torch.float32),
          gemm.matmul(x, (qc.float() * cs).to(HALF).to(DEVICE), rows, torch.float32))
    words, s4, q4 = _int4(w)
    int4 = wtiles.quantized("w4a16", {"weight_packed": words.to(DEVICE), "weight_scale": s4.to(DEVICE)},
                            {"group": 128})
    deq4 = (q4.float() * s4.float().repeat_interleave(128, 1)).to(HALF).to(DEVICE)
    _same(gemm.matmul(x, int4, rows, torch.float32), gemm.matmul(x, deq4, rows, torch.float32))
    int3, deq3 = _int3(w)
    _same(gemm.matmul(x, int3, rows, torch.float32), gemm.matmul(x, deq3, rows, torch.float32))



def test_prefetch_lines_spread_the_launch_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mocked budget (Triton's interpreter has no programmatic launch, so nothing is prefetched in this suite;
    tests/gpu/test_gemm_prefetch.py runs the prefetching builds): the weight slices of a decode launch share the
    budget, each prefetching a power of two of lines of its rows, never past its own K span, whatever the rows (one
    build for every row count); formats whose rows are not plain elements, K-strided weights and a zero budget
    prefetch nothing."""
    from kernels.gpu import wtiles
    budget = 16 << 20
    monkeypatch.setattr(gemm.pdl, "prefetch_bytes", lambda: budget)
    n, k = 24576, 4096
    tile = gemm.schedule(n, k, gemm.RowClass.DECODE)
    programs = (n // tile.block_n) * tile.split_k
    per_split = k // tile.split_k
    w8 = wtiles.WeightArgs(wtiles.Fmt.FP8_BLOCK, torch.empty(1, n, k, dtype=torch.float8_e4m3fn), torch.empty(1),
                           128, 128)
    lines, step = gemm.prefetch_lines(w8, tile, per_split, programs)
    assert step == 128 and lines > 0 and lines & (lines - 1) == 0
    assert lines * programs * tile.block_n * 128 <= budget < 2 * lines * programs * tile.block_n * 128
    bf16 = gemm.dense(torch.empty(n, k, dtype=torch.bfloat16))
    assert gemm.prefetch_lines(bf16, tile, per_split, programs) == (lines, 64)  # the same bytes: half the K
    monkeypatch.setattr(gemm.pdl, "prefetch_bytes", lambda: 1 << 40)  # more than the weight: its own K span
    assert gemm.prefetch_lines(bf16, tile, per_split, programs) == (per_split // 64, 64)
    assert gemm.prefetch_lines(gemm.dense(torch.empty(k, n, dtype=torch.bfloat16).T), tile, per_split, programs)[0] == 0
    int4 = wtiles.WeightArgs(wtiles.Fmt.INT4, torch.empty(1, n, k // 8, dtype=torch.int32), torch.empty(1), 1, 128)
    assert gemm.prefetch_lines(int4, tile, per_split, programs)[0] == 0
    monkeypatch.setattr(gemm.pdl, "prefetch_bytes", lambda: 0)
    assert gemm.prefetch_lines(w8, tile, per_split, programs) == (0, 1)
