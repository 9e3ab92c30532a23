"""The fused GPU MoE (kernels/gpu/moe.py) against its torch twin (kernels/moe.py + the shared expert), and its row
invariance: a row's output alone equals its output among other rows, whatever they route to."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF, HALF_TOL, randn

from kernels import moe as ref  # noqa: E402
from kernels.gpu import gemm, moe  # noqa: E402

E, K, D, I, LIMIT = 8, 2, 64, 32, 10.0
CLASSES = {"decode": 1 << 30, "prefill": 0}  # decode_rows: every row decode-class / a prompt row


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(router=randn(E, D, seed=1, scale=0.3), bias=randn(E, dtype=torch.float32, seed=2, scale=0.1),
                gate=randn(E + 1, I, D, seed=3, scale=0.2), up=randn(E + 1, I, D, seed=4, scale=0.2),
                down=randn(E + 1, D, I, seed=5, scale=0.2))


def gpu_moe(x: torch.Tensor, w: dict[str, torch.Tensor], rows: int, n_real: int | None = None) -> torch.Tensor:
    # the router through the fixed-schedule GEMM, as the model does (a cuBLAS product moves bits with the row count)
    logits = gemm.matmul(x, w["router"], rows, torch.float32)
    ids, rw = moe.route(logits, w["bias"], top_k=K, norm_topk_prob=True, scaling=2.5,
                        n_real=x.shape[0] if n_real is None else n_real)
    return moe.experts(x, ids, rw, w["gate"], w["up"], w["down"], LIMIT, rows)


def torch_moe(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    xc, f = x.cpu().float(), {k: v.cpu().float() for k, v in w.items()}
    ids, rw = ref.route(xc, f["router"], f["bias"], top_k=K, n_group=1, topk_group=1, norm_topk_prob=True,
                        scaling=2.5)
    routed = ref.experts(xc, ids, rw, f["gate"][:E], f["up"][:E], f["down"][:E], LIMIT)
    shared = ref.swiglu(xc @ f["gate"][E].T, xc @ f["up"][E].T, LIMIT) @ f["down"][E].T
    return routed + shared


def test_route_matches_reference(weights: dict[str, torch.Tensor]) -> None:
    x = randn(30, D, seed=6)
    logits = gemm.matmul(x, weights["router"], 0, torch.float32)
    ids, rw = moe.route(logits, weights["bias"], top_k=K, norm_topk_prob=True, scaling=2.5, n_real=27)
    rids, rrw = ref.route(x.cpu().float(), weights["router"].cpu().float(), weights["bias"].cpu(), top_k=K,
                          n_group=1, topk_group=1, norm_topk_prob=True, scaling=2.5)
    order = torch.sort(rids, dim=1).indices  # the GPU kernel lists routed experts in ascending order
    assert torch.equal(ids[:27, :K].cpu().long(), torch.gather(rids, 1, order)[:27])
    torch.testing.assert_close(rw[:27, :K].cpu(), torch.gather(rrw, 1, order)[:27], rtol=1e-5, atol=1e-6)
    assert torch.all(ids[:27, K].cpu() == E) and torch.all(rw[:27, K].cpu() == 1.0)  # the shared expert
    assert torch.all(ids[27:].cpu() == E + 1) and torch.all(rw[27:].cpu() == 0)  # padding rows: no pairs


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_experts_match_torch_twin(weights: dict[str, torch.Tensor], rows: int) -> None:
    x = randn(40, D, seed=7)
    out = gpu_moe(x, weights, rows)
    torch.testing.assert_close(out.cpu(), torch_moe(x, weights), **HALF_TOL)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_padding_rows_are_not_routed(weights: dict[str, torch.Tensor], rows: int) -> None:
    x = randn(12, D, seed=8)
    out = gpu_moe(x, weights, rows, n_real=5)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    assert torch.equal(out[:5], gpu_moe(x[:5], weights, rows))


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_row_alone_equals_row_in_company(weights: dict[str, torch.Tensor], rows: int) -> None:
    crowd = randn(90, D, seed=9)
    alone = gpu_moe(crowd[40:41], weights, rows)[0]
    for m in (3, 41, 90):
        batch = crowd[:m] if m > 40 else torch.cat([crowd[:m - 1], crowd[40:41]])
        row = gpu_moe(batch, weights, rows)[40 if m > 40 else m - 1]
        assert torch.equal(row, alone), f"row changed beside {m - 1} others"


def test_mixed_classes_split_by_row(weights: dict[str, torch.Tensor]) -> None:
    x = randn(20, D, seed=10)
    mixed = gpu_moe(x, weights, 6)
    assert torch.equal(mixed[:6], gpu_moe(x[:6], weights, CLASSES["decode"]))
    assert torch.equal(mixed[6:], gpu_moe(x[6:], weights, CLASSES["prefill"]))


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_quantized_experts_equal_their_dequantized_twin_bit_for_bit(rows: int) -> None:
    """int4 (group 128) and fp8 (128-blocks) expert stacks: the grouped kernels dequantize each tile as the twin
    does, so the result equals the dense kernels' on the dequantized stacks exactly."""
    from kernels.gpu import wtiles
    from tests.kernels.test_gpu_gemm import _fp8_block, _int4
    e, d, i = 5, 256, 128
    dense = {n: randn(e, *shape, seed=30 + j, scale=0.05).float().cpu()
             for j, (n, shape) in enumerate((("gate", (i, d)), ("up", (i, d)), ("down", (d, i))))}
    x = randn(24, d, seed=34)
    router = randn(e - 1, d, seed=35, scale=0.3)
    logits = gemm.matmul(x, router, rows, torch.float32)
    ids, rw = moe.route(logits, torch.zeros(e - 1, device=DEVICE), top_k=2, norm_topk_prob=True, scaling=1.0,
                        n_real=x.shape[0])

    def stack(fn):
        parts = [fn(w) for w in dense["gate"]], [fn(w) for w in dense["up"]], [fn(w) for w in dense["down"]]
        return parts

    fp8 = stack(_fp8_block)
    quant = [wtiles.quantized("fp8", {"weight": torch.stack([q for q, _ in p]).to(DEVICE),
                                      "weight_scale_inv": torch.stack([s for _, s in p]).to(DEVICE)},
                              {"block": (128, 128)}) for p in fp8]
    deq = [torch.stack([(q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)) for q, s in p])
           .to(HALF).to(DEVICE) for p in fp8]
    assert torch.equal(moe.experts(x, ids, rw, *quant, LIMIT, rows), moe.experts(x, ids, rw, *deq, LIMIT, rows))
    int4 = stack(_int4)
    quant = [wtiles.quantized("w4a16", {"weight_packed": torch.stack([w for w, _, _ in p]).to(DEVICE),
                                        "weight_scale": torch.stack([s for _, s, _ in p]).to(DEVICE)},
                              {"group": 128}) for p in int4]
    deq = [torch.stack([q.float() * s.float().repeat_interleave(128, 1) for _, s, q in p]).to(HALF).to(DEVICE)
           for p in int4]
    assert torch.equal(moe.experts(x, ids, rw, *quant, LIMIT, rows), moe.experts(x, ids, rw, *deq, LIMIT, rows))
