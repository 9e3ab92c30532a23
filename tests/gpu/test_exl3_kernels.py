"""EXL3 on the GPU at real GLM-5.3-Flash dims (hidden 4096, dense MLP 12288, experts 2048 wide, top-8; 32 + 1 of
the 288 experts in the kernel tests, all of them in the model ones): our fixed-schedule GEMM and grouped MoE over
trellis tiles (kernels/gpu), bf16 activations.

- a row alone = the same row among 2..2,048 rows, bit for bit, for both row classes (docs/design.md §5.1);
- against the torch twin (x @ dequantize(twin).T in fp32 on the GPU) within the float16 rounding of the rotated
  rows (tests/kernels/test_gpu_exl3.py states why; here a normwise bound and a max bound, both printed);
- a model of two real-dim layers (KDA + dense FFN, MLA + MoE) with every eligible linear drawn as EXL3: a decode
  row's logits alone = among 2,048 rows, and a CUDA-graph replay = the eager step.
Run with `-s` to log the figures (max |delta|, relative errors, microseconds per call).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
CLASSES = {"decode": 1 << 30, "prefill": 0}
COMPANY = (2, 3, 8, 15, 16, 17, 64, 65, 100, 144, 145, 250, 700, 2048)
NORM_TOL = 1e-3  # ||ours - twin|| / ||twin|| (measured on the CPU: ~2.5e-4 elementwise relative)
MAX_TOL = 4e-3  # max |ours - twin| / max |twin|


def _weight(out: int, inp: int, seed: int, bits: float = 4, codebook: str = "mul1"):
    from kernels.gpu import wtiles
    from kernels.quant import random_quantized
    q = random_quantized("exl3", out, inp, std=0.02, bits=bits, codebook=codebook,
                         generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV)
    return q, wtiles.quantized("exl3", q.tensors, dict(q.params))


def _rows(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV).to(torch.bfloat16)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    d = (got.double() - want.double())
    return (d.norm() / want.double().norm()).item(), (d.abs().max() / want.double().abs().max()).item()


def _placed(crowd: torch.Tensor, target: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
    """m rows: the target at position m // 2 among crowd rows."""
    at = m // 2
    return torch.cat([crowd[:at], target, crowd[at:m - 1]]), at


def _usec(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


@pytest.mark.parametrize("shape", [(12288, 4096), (4096, 12288)], ids=["4096to12288", "12288to4096"])
@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_gemm_row_alone_equals_row_among_2048(shape: tuple[int, int], rows: int) -> None:
    from kernels.gpu import gemm
    out, inp = shape
    _, w = _weight(out, inp, seed=1)
    crowd, target = _rows(2048, inp, seed=2), _rows(1, inp, seed=3)
    alone = gemm.matmul(target, w, rows, torch.float32)[0]
    changed = []
    for m in COMPANY:
        batch, at = _placed(crowd, target, m)
        row = gemm.matmul(batch, w, rows, torch.float32)[at]
        if not torch.equal(row, alone):
            changed.append((m, (row - alone).abs().max().item()))
    print(f"\nEXL3 GEMM {inp}->{out} {'decode' if rows else 'prefill'} rows: row alone vs among {COMPANY}: "
          f"{len(changed)} differ {changed}")
    assert not changed


@pytest.mark.parametrize("bits,codebook", [(4, "mul1"), (2, "3inst"), (3, "mcg")])
def test_gemm_matches_twin(bits: float, codebook: str) -> None:
    from kernels.gpu import gemm
    q, w = _weight(12288, 4096, seed=4, bits=bits, codebook=codebook)
    dense = q.dequantize()  # fp32 [out, in] on the GPU
    x = _rows(64, 4096, seed=5)
    want = x.float() @ dense.T
    for name, rows in CLASSES.items():
        norm, mx = _errors(gemm.matmul(x, w, rows, torch.float32), want)
        print(f"\nEXL3 GEMM {bits} bits {codebook} {name}: vs twin normwise {norm:.2e}, max {mx:.2e}")
        assert norm <= NORM_TOL and mx <= MAX_TOL
    # speed figures for the log (not asserted): one row, and bf16 through the same GEMM for scale
    wb = dense.to(torch.bfloat16)
    x1, x2048 = x[:1], _rows(2048, 4096, seed=6)
    print(f"  1 row: EXL3 {_usec(lambda: gemm.matmul(x1, w, 1)):.1f} us, bf16 (same GEMM) "
          f"{_usec(lambda: gemm.matmul(x1, wb, 1)):.1f} us; 2048 prompt rows: EXL3 "
          f"{_usec(lambda: gemm.matmul(x2048, w, 0), reps=10):.0f} us, bf16 "
          f"{_usec(lambda: gemm.matmul(x2048, wb, 0), reps=10):.0f} us")


E, TOP_K, D, I, LIMIT = 32, 8, 4096, 2048, 10.0


@pytest.fixture(scope="module")
def experts() -> dict:
    from kernels.gpu import wtiles
    from kernels.quant import random_quantized
    g = torch.Generator(device=DEV).manual_seed(7)
    out = {}
    for name, (o, i) in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
        qs = [random_quantized("exl3", o, i, std=0.02, generator=g, device=DEV) for _ in range(E + 1)]
        out[name] = wtiles.stack_quantized(qs)
        out[name + "_q"] = qs
    out["router"] = (torch.randn(E, D, generator=g, device=DEV) * 0.02).to(torch.bfloat16)
    out["bias"] = torch.zeros(E, device=DEV)
    return out


def _route(x: torch.Tensor, w: dict, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    from kernels.gpu import gemm, moe
    logits = gemm.matmul(x, w["router"], rows, torch.float32)
    return moe.route(logits, w["bias"], top_k=TOP_K, norm_topk_prob=True, scaling=2.5, n_real=x.shape[0])


def _moe(x: torch.Tensor, w: dict, rows: int) -> torch.Tensor:
    from kernels.gpu import moe
    ids, rw = _route(x, w, rows)
    return moe.experts(x, ids, rw, w["gate"], w["up"], w["down"], LIMIT, rows)[0]


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_moe_row_alone_equals_row_among_2048(experts: dict, rows: int) -> None:
    crowd, target = _rows(2048, D, seed=8), _rows(1, D, seed=9)
    alone = _moe(target, experts, rows)[0]
    changed = []
    for m in COMPANY:
        batch, at = _placed(crowd, target, m)
        row = _moe(batch, experts, rows)[at]
        if not torch.equal(row, alone):
            changed.append((m, (row - alone).abs().max().item()))
    print(f"\nEXL3 MoE {E}+1 experts top-{TOP_K} {D}x{I} {'decode' if rows else 'prefill'} rows: row alone vs among "
          f"{COMPANY}: {len(changed)} differ {changed}")
    assert not changed


def test_moe_matches_twin(experts: dict) -> None:
    from kernels import moe as ref
    x = _rows(64, D, seed=10)
    xf = x.float()
    dense = {n: torch.stack([q.dequantize() for q in experts[n + "_q"]]) for n in ("gate", "up", "down")}
    ids, rw = _route(x, experts, 0)  # the twin takes our routing: a near-tie flipped by rounding is not EXL3's error
    g, u, d = dense["gate"], dense["up"], dense["down"]
    want = (ref.experts(xf, ids[:, :TOP_K].long(), rw[:, :TOP_K], g[:E], u[:E], d[:E], LIMIT)
            + ref.swiglu(xf @ g[E].T, xf @ u[E].T, LIMIT) @ d[E].T)
    for name, rows in CLASSES.items():
        norm, mx = _errors(_moe(x, experts, rows), want)
        print(f"\nEXL3 MoE {name}: vs twin normwise {norm:.2e}, max {mx:.2e} (gate / up rounded to bf16 as the twin's "
              f"bf16 path does)")
        # bf16 rounding of the gate / up projections (2^-9 relative) dominates here, not EXL3's float16 operands
        assert norm <= 1e-2 and mx <= 3e-2
    x1 = x[:1]
    print(f"  1 row: {_usec(lambda: _moe(x1, experts, 1)):.1f} us (router + route + grouped EXL3 experts)")


@pytest.fixture(scope="module")
def model():
    from bench.random_weights import bench_spec, build_model
    from model.quantize.select import Recipe
    m, _ = build_model(bench_spec(layers=2, layer_pattern="KM"), device=DEV, dtype=torch.bfloat16, seed=0,
                       recipe=Recipe.parse("exl3"))
    return m


def test_model_with_exl3_experts_decode_row_alone_equals_row_among_2048(model) -> None:
    """test_fast_path.py's check (a decode row alone = beside decode rows, a verify window and prompt chunks of 1 to
    1,030 rows: 2,048 rows) on the EXL3 model."""
    from kernels.gpu.wtiles import Fmt
    from tests.gpu import test_fast_path
    moe = model.layers[1].ffn
    assert moe.params.packed and moe.params.gate[0].fmt is Fmt.EXL3 and moe.shared_apart is None  # shared inside
    test_fast_path.test_decode_row_alone_equals_row_among_2048(model)


def test_model_with_exl3_experts_graph_replay_equals_eager(model) -> None:
    from tests.gpu import test_fast_path
    test_fast_path.test_graph_replay_equals_eager(model)
