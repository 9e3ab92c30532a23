"""bench/library_schedule.py, the library twins of bench.decode_prefill's `--schedule ours,library`, on the CPU: the
swap patches the fused ops' entry points and puts them back; each twin computes the math of the product it replaces
(torch's products run on the CPU too; our entry points run in Triton's interpreter, tests/conftest.py); formats no
library reads stay ours and are recorded as kept; and the bench's tiny mode runs both schedules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, randn

from bench import library_schedule as lib  # noqa: E402  (after the importorskip in gpu_support)
from bench.library_schedule import SwapRecord, library_schedule  # noqa: E402
from kernels import moe as ref  # noqa: E402
from kernels.gpu import gemm, int_moe, wtiles  # noqa: E402
from kernels.gpu import moe as gpu_moe  # noqa: E402
from kernels.quant import fp8 as qfp8, w4a16  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
E, TOPK, D, I, LIMIT = 4, 2, 64, 32, 10.0


def entry_points() -> list:
    return [gemm.bmm, gemm.matmul, gpu_moe.experts, int_moe.experts, int_moe._product]


def test_the_swap_patches_and_restores_the_entry_points():
    before = entry_points()
    with library_schedule() as record:
        inside = entry_points()
        assert all(a is not b for a, b in zip(before, inside))
        assert isinstance(record, SwapRecord)
    assert all(a is b for a, b in zip(before, entry_points()))
    with pytest.raises(RuntimeError, match="boom"):
        with library_schedule():
            raise RuntimeError("boom")
    assert all(a is b for a, b in zip(before, entry_points()))


def test_dense_products_are_torch_products_of_the_same_math():
    """One weight, a stack with the input broadcast (one product over the stacked weights), a batched product, an
    fp32 output, a wider output's columns written in place, matmul's leading dims; each kind's first call is
    checked against ours (the interpreter) and recorded."""
    x = randn(5, 64, seed=1)
    w = randn(32, 64, seed=2, scale=0.1)
    stack = randn(3, 32, 64, seed=3, scale=0.1)
    xs = randn(3, 5, 64, seed=4)
    want = x.float() @ w.float().T
    with library_schedule() as record:
        y = gemm.bmm(x.unsqueeze(0), w, 5)
        y32 = gemm.bmm(x.unsqueeze(0), w, 0, torch.float32)
        broadcast = gemm.bmm(x.unsqueeze(0).expand(3, -1, -1), stack, 5, torch.float32)
        batched = gemm.bmm(xs, stack, 5, torch.float32)
        wide = torch.zeros(1, 5, 48, dtype=torch.float32)
        gemm.bmm(x.unsqueeze(0), w, 5, torch.float32, out=wide[..., 8:40])
        lead = gemm.matmul(x.view(1, 5, 64), w, 5, torch.float32)
    assert y.dtype == HALF and y32.dtype == torch.float32
    torch.testing.assert_close(y[0].float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y32[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(broadcast, torch.einsum("mk,bnk->bmn", x.float(), stack.float()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched, torch.einsum("bmk,bnk->bmn", xs.float(), stack.float()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wide[0, :, 8:40], want, rtol=1e-4, atol=1e-4)
    assert not wide[..., :8].any() and not wide[..., 40:].any()
    torch.testing.assert_close(lead, want.view(1, 5, 32), rtol=1e-4, atol=1e-4)
    assert record.swapped[lib.DENSE] == 6 and not record.kept and not record.refused
    assert record.checks[lib.DENSE] < 1e-3  # the first call against ours, in the interpreter


def _fp8_weight(n: int, k: int, block: bool, seed: int) -> tuple[wtiles.WeightArgs, torch.Tensor]:
    """An fp8 [N, K] weight (128 x 128 blocks or per-channel scales) as kernel WeightArgs, and its dequantized
    fp32 twin."""
    w = randn(n, k, dtype=torch.float32, seed=seed, scale=0.05).cpu()
    if block:
        t = qfp8.quantize_blocks(w)
        params = {"block": (128, 128)}
    else:
        t = qfp8.quantize_channels(w)
        params = {"block": None}
    deq = qfp8.CODEC.dequantize(t, (n, k), params)
    return wtiles.quantized("fp8", {name: v.to(DEVICE) for name, v in t.items()}, params), deq


def _dequantized_activations(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x as the fp8 twin's activation quantization leaves it: e4m3 values times their row's / group's scale."""
    q, s = lib.quantize_rows(x) if group is None else lib.quantize_groups(x, group)
    return q.float() * (s if group is None else s.repeat_interleave(group, 1))


@pytest.mark.parametrize("block", [True, False], ids=["blocks", "channels"])
def test_fp8_products_are_scaled_mm_of_the_same_weights(block: bool):
    """The twin = cuBLASLt's math (e4m3 activations x e4m3 weights, scales applied to the fp32 accumulator) on the
    stored fp8 weights: equal to that math computed in fp32, and within the activations' e4m3 rounding of ours
    (W8A16: the activations stay 16-bit)."""
    n, k = 256, 256
    wa, deq = _fp8_weight(n, k, block, seed=10)
    x = randn(7, k, seed=11)
    with library_schedule() as record:
        y = gemm.matmul(x, wa, 7, torch.float32)
    exact = _dequantized_activations(x.float().cpu(), 128 if block else None) @ deq.T
    # per-channel: the row-wise kernel writes a 16-bit output (then widened to the fp32 asked for)
    tol = 1e-4 if block else 2e-3
    torch.testing.assert_close(y.cpu(), exact, rtol=tol, atol=tol)
    ours = x.float().cpu() @ deq.to(x.dtype).float().T  # our product: the weight rounded to x's dtype, fp32 sums
    assert lib.relative_difference(y.cpu(), ours) < 0.06
    assert record.swapped == {lib.FP8: 1} and record.checks[lib.FP8] < 0.06


def test_quantization_rule_is_the_weights_one():
    """scale = amax / 448 per row or group, 1 for an all-zero one, values rounded to e4m3."""
    x = torch.tensor([[0.0] * 128 + [1.0, -448.0 * 3] + [0.0] * 126])
    q, s = lib.quantize_groups(x)
    assert s.tolist() == [[1.0, 3.0]] and q.float()[0, 129].item() == -448.0
    q, s = lib.quantize_rows(x)
    assert s.tolist() == [[3.0]] and q.float()[0, 128].item() == pytest.approx(1 / 3, rel=0.07)


def _routing(t: int, shared: bool = True, padding: int = 2, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """ids / weights as kernels.gpu.moe.route lays them out: TOPK routed experts ascending, the shared one (E)
    last, padding rows' pairs E + 1 with weight 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.sort(torch.randperm(E, generator=g)[:TOPK]).values for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, TOPK, generator=g)
    if shared:
        ids = torch.cat([ids, torch.full((t, 1), E, dtype=torch.int32)], 1)
        w = torch.cat([w, torch.ones(t, 1)], 1)
    ids[t - padding:] = E + 1
    w[t - padding:] = 0
    return ids.to(DEVICE), w.to(DEVICE)


def _twin_experts(x, ids, w, gate, up, down, shards: int) -> torch.Tensor:
    """kernels/moe.py's torch twin per virtual shard (the shared expert is expert E of the stacks) -> [S, T, D]."""
    xc, ids, w = x.float().cpu(), ids.cpu().long(), w.cpu()
    gate, up, down = (t.float().cpu() for t in (gate, up, down))
    real = ids < gate.shape[0]
    width = gate.shape[1] // shards
    outs = []
    for s in range(shards):
        cols = slice(s * width, (s + 1) * width)
        n = gate.shape[0]
        out = torch.zeros(x.shape[0], x.shape[1])
        rows = real.any(1)
        out[rows] = ref.experts(xc[rows], ids[rows].clamp(max=n - 1), torch.where(real, w, 0)[rows],
                                gate[:, cols], up[:, cols], down[s * n:(s + 1) * n], LIMIT)
        outs.append(out)
    return torch.stack(outs)


@pytest.mark.parametrize("shards", [1, 2])
def test_dense_experts_are_grouped_mm_of_the_same_math(shards: int):
    """torch._grouped_mm over the pairs sorted by expert = the torch twin's experts, every virtual shard's partial,
    padding rows zero; checked against ours on the first call."""
    x = randn(9, D, seed=6)
    gate, up = randn(E + 1, I, D, seed=7, scale=0.2), randn(E + 1, I, D, seed=8, scale=0.2)
    down = randn(shards * (E + 1), D, I // shards, seed=9, scale=0.2)
    ids, w = _routing(9)
    with library_schedule() as record:
        out = gpu_moe.experts(x, ids, w, gate, up, down, LIMIT, 9, shards=shards)
    assert out.shape == (shards, 9, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), _twin_experts(x, ids, w, gate, up, down, shards), rtol=2e-2, atol=2e-2)
    assert not out[:, -2:].any()
    assert record.swapped == {lib.DENSE_EXPERTS: 1} and record.checks[lib.DENSE_EXPERTS] < 1e-2


def test_fp8_experts_are_the_block_scaled_math():
    """The fp8 experts' twin (its CPU form: per expert, the block-scaled product of e4m3 activations) = that math in
    fp32, and within the activations' rounding of the dequantized experts' torch twin."""
    dim, inter = 256, 256
    stacks = []
    deqs = []
    for which, (n, k) in enumerate(((inter, dim), (inter, dim), (dim, inter))):
        parts = [_fp8_weight(n, k, True, seed=20 + 3 * e + which) for e in range(E + 1)]
        stacks.append(wtiles.WeightArgs(wtiles.Fmt.FP8_BLOCK, torch.cat([p.data for p, _ in parts]),
                                        torch.cat([p.scale for p, _ in parts]), 128, 128))
        deqs.append(torch.stack([d for _, d in parts]))
    x = randn(6, dim, seed=30)
    ids, w = _routing(6, padding=1)
    out = lib.library_experts(x, ids, w, *stacks, LIMIT)
    want = _twin_experts(x, ids, w, *deqs, shards=1)
    assert lib.relative_difference(out.cpu(), want) < 0.06
    assert not out[:, -1:].any()


def test_formats_without_a_library_kernel_stay_ours():
    """A W4A16 product under the swap is ours, bit for bit, and recorded as kept with the reason."""
    t = w4a16.quantize(randn(64, 128, dtype=torch.float32, seed=40, scale=0.05).cpu(), 128)
    wa = wtiles.quantized("w4a16", {n: v.to(DEVICE) for n, v in t.items()}, {"group": 128})
    x = randn(3, 128, seed=41)
    want = gemm.matmul(x, wa, 3, torch.float32)
    with library_schedule() as record:
        got = gemm.matmul(x, wa, 3, torch.float32)
    assert torch.equal(got, want)
    assert not record.swapped and record.kept == {"w4a16 products": {"calls": 1, "why": lib.NO_LIBRARY}}


def test_a_twin_that_fails_is_turned_off_and_ours_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    monkeypatch.setattr(lib, "dense_product", refuse)
    x, w = randn(4, 64, seed=50), randn(16, 64, seed=51)
    want = gemm.matmul(x, w, 4, torch.float32)
    with library_schedule() as record:
        first = gemm.matmul(x, w, 4, torch.float32)
        second = gemm.matmul(x, w, 4, torch.float32)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert not record.swapped and "CUBLAS_STATUS_NOT_SUPPORTED" in record.refused[lib.DENSE]
    assert record.kept[lib.DENSE]["calls"] == 2


def test_a_twin_that_disagrees_with_ours_is_turned_off(monkeypatch):
    monkeypatch.setattr(lib, "dense_product", lambda x, w, dtype: torch.zeros(x.shape[0], x.shape[1], w.shape[1],
                                                                              dtype=dtype))
    x, w = randn(4, 64, seed=52), randn(16, 64, seed=53)
    with library_schedule() as record:
        got = gemm.matmul(x, w, 4, torch.float32)
    assert torch.equal(got, gemm.matmul(x, w, 4, torch.float32))
    assert record.checks[lib.DENSE] == pytest.approx(1.0) and "differs from ours" in record.refused[lib.DENSE]


def test_stream_k_locks_meet_humming_launchers_floor():
    """humming's check_tensor_locks: (clusters of resident CTAs + a tenth) x cluster size x a tile's locks, on the
    config's SM cap or the GPU's; none without stream-K (batch-invariant configs, ours)."""
    cfg = {"block_shape": [64, 256, 64], "warp_shape": [64, 64, 64], "use_stream_k": True, "num_ctas_per_sm": 2}
    assert lib.stream_k_locks(cfg, 132) == 264 + 26  # 4 warps: one output warpgroup, one lock a tile
    assert lib.stream_k_locks(cfg | {"num_sms": 100}, 132) == 200 + 20
    assert lib.stream_k_locks(cfg | {"block_shape": [128, 256, 64]}, 132) == 2 * (264 + 26)  # two warpgroups
    assert lib.stream_k_locks(cfg | {"multi_cast_size_a": 2}, 132) == 2 * (132 + 13)  # the tenth is of clusters
    assert lib.stream_k_locks(cfg | {"use_stream_k": False}, 132) == 0


def test_schedule_flag():
    from bench.decode_prefill import parse_args
    assert parse_args(["--tiny"]).schedule == ["ours"]
    assert parse_args(["--tiny", "--schedule", "library,ours"]).schedule == ["ours", "library"]
    for bad in ("library", "ours,cublas"):
        with pytest.raises(SystemExit):
            parse_args(["--tiny", "--schedule", bad])


def test_price_table():
    from bench.decode_prefill import price_markdown, price_rows
    data = {"decode": [{"batch": 1, "status": "ok", "median_ms": 3.0,
                        "library": {"status": "ok", "median_ms": 2.0, "swapped": [lib.DENSE], "kept": []}},
                       {"batch": 8, "status": "ok", "median_ms": 4.0}],
            "prefill": [{"tokens": 8192, "status": "ok", "median_ms": 500.0,
                         "library": {"status": "OOM", "swapped": [], "kept": []}}]}
    rows = price_rows(data)
    assert [r["config"] for r in rows] == ["decode batch 1", "prefill 8192"]
    assert rows[0]["ours_over_library"] == 1.5 and rows[1]["ours_over_library"] is None
    record = SwapRecord()
    record.ran(lib.DENSE)
    md = "\n".join(price_markdown({"rows": rows, **record.as_dict()}))
    assert "| decode batch 1 | 3.00 | 2.00 | 1.500 | dense products |" in md
    assert "| prefill 8192 | | | ours ok, library OOM | |" in md and "- swapped: dense products" in md


def test_decode_prefill_tiny_runs_both_schedules(tmp_path):
    cmd = [sys.executable, "-m", "bench.decode_prefill", "--tiny", "--batches", "1", "--prefill", "64", "--iters",
           "1", "--schedule", "ours,library", "--out", str(tmp_path), "--name", "price"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "price.json").read_text())
    price = data["price_of_exactness"]
    assert [(r["config"], r["status"]) for r in price["rows"]] == [("decode batch 1", "ok"), ("prefill 64", "ok")]
    assert all(r["ours_over_library"] > 0 for r in price["rows"])
    assert data["decode"][0]["library"]["status"] == "ok" and data["prefill"][0]["library"]["chunk"] == 0
    # on the CPU the reference ops call no patched entry point: nothing swapped, and the results say so
    assert price["swapped"] == {} and "attention" in price["never_swapped"]
    md = (tmp_path / "price.md").read_text()
    assert "## The price of exactness (ours / library)" in md and "- swapped: none" in md
