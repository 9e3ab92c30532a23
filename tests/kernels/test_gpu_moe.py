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
    return moe.experts(x, ids, rw, w["gate"], w["up"], w["down"], LIMIT, rows)[0]


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


QE, QD, QI = 5, 256, 128  # quantized stacks: 4 routed experts + the shared one, one 128 group / block per edge


def quantized_stacks(fmt: str) -> tuple[list, list[torch.Tensor]]:
    """gate, up, down expert stacks in `fmt` (fp8 128-blocks or int4 group 128) as kernel WeightArgs, and the twin's
    dequantized stacks (dense, activation dtype)."""
    from kernels.gpu import wtiles
    from tests.kernels.test_gpu_gemm import _fp8_block, _int4
    dense = [randn(QE, *shape, seed=30 + j, scale=0.05).float().cpu()
             for j, shape in enumerate(((QI, QD), (QI, QD), (QD, QI)))]
    quant, deq = [], []
    for stack in dense:
        if fmt == "fp8":
            parts = [_fp8_block(w) for w in stack]
            quant.append(wtiles.quantized("fp8", {"weight": torch.stack([q for q, _ in parts]).to(DEVICE),
                                                  "weight_scale_inv": torch.stack([s for _, s in parts]).to(DEVICE)},
                                          {"block": (128, 128)}))
            deq.append(torch.stack([q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
                                    for q, s in parts]).to(HALF).to(DEVICE))
        else:
            parts = [_int4(w) for w in stack]
            quant.append(wtiles.quantized("w4a16", {"weight_packed": torch.stack([w for w, _, _ in parts]).to(DEVICE),
                                                    "weight_scale": torch.stack([s for _, s, _ in parts]).to(DEVICE)},
                                          {"group": 128}))
            deq.append(torch.stack([q.float() * s.float().repeat_interleave(128, 1) for _, s, q in parts])
                       .to(HALF).to(DEVICE))
    return quant, deq


def quantized_moe(x: torch.Tensor, stacks: list, rows: int) -> torch.Tensor:
    router = randn(QE - 1, QD, seed=35, scale=0.3)
    logits = gemm.matmul(x, router, rows, torch.float32)
    ids, rw = moe.route(logits, torch.zeros(QE - 1, device=DEVICE), top_k=2, norm_topk_prob=True, scaling=1.0,
                        n_real=x.shape[0])
    return moe.experts(x, ids, rw, *stacks, LIMIT, rows)[0]


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
@pytest.mark.parametrize("fmt", ["fp8", "w4a16"])
def test_quantized_experts_match_their_dequantized_twin(fmt: str, rows: int) -> None:
    """The grouped kernels dequantize each tile as the twin does (value x scale in fp32, rounded to the activation
    dtype) under the dense schedule: the output matches the dense kernels on the twin's dequantized stacks (the test
    prints whether bit for bit: the compiler may lower a register-built tile's dot differently from a loaded one)."""
    quant, deq = quantized_stacks(fmt)
    x = randn(24, QD, seed=34)
    got, want = quantized_moe(x, quant, rows), quantized_moe(x, deq, rows)
    diff = float((got - want).abs().max())
    print(f"MoE {fmt} {'decode' if rows else 'prefill'} class: max |quantized - dequantized dense| = {diff:.3g}"
          f" ({'bit-identical' if diff == 0 else 'not bit-identical'})")
    torch.testing.assert_close(got, want, **HALF_TOL)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
@pytest.mark.parametrize("fmt", ["fp8", "w4a16"])
def test_quantized_row_alone_equals_row_in_company(fmt: str, rows: int) -> None:
    quant, _ = quantized_stacks(fmt)
    big = 300 if DEVICE == "cuda" else 90  # the CPU interpreter runs every program in Python
    crowd = randn(big, QD, seed=36)
    alone = quantized_moe(crowd[40:41], quant, rows)[0]
    for m in (2, 17, 41, big):
        batch = crowd[:m] if m > 40 else torch.cat([crowd[:m - 1], crowd[40:41]])
        row = quantized_moe(batch, quant, rows)[40 if m > 40 else m - 1]
        assert torch.equal(row, alone), f"{fmt}: row changed beside {m - 1} others"


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_shards_in_one_launch_equal_one_launch_per_shard(weights: dict[str, torch.Tensor], rows: int) -> None:
    """Virtual shards (I cut in 2 and 4) computed by one launch = each shard's own one-shard launch, bit for bit:
    the per-element arithmetic never depends on how many shards share the launch (TP=1 computes 4, TP=2 two)."""
    x = randn(21, D, seed=11)
    logits = gemm.matmul(x, weights["router"], rows, torch.float32)
    ids, rw = moe.route(logits, weights["bias"], top_k=K, norm_topk_prob=True, scaling=2.5, n_real=x.shape[0])
    for shards in (2, 4):
        w = I // shards
        downs = [weights["down"][:, :, j * w : (j + 1) * w] for j in range(shards)]
        fused = moe.experts(x, ids, rw, weights["gate"], weights["up"], torch.cat(downs).contiguous(), LIMIT, rows,
                            shards=shards)
        for j in range(shards):
            alone = moe.experts(x, ids, rw, weights["gate"][:, j * w : (j + 1) * w].contiguous(),
                                weights["up"][:, j * w : (j + 1) * w].contiguous(), downs[j].contiguous(), LIMIT,
                                rows)[0]
            assert torch.equal(fused[j], alone), f"shard {j} of {shards}"


def test_tile_order_changes_no_bit(weights: dict[str, torch.Tensor]) -> None:
    """Grouped ordering (kernels/gpu/tile_order.py) decides which program computes a tile, never the tile's
    arithmetic: column tiles fastest, row tiles fastest and partial groups give the same bits, and the twin's
    values. Small tiles, so there are many row tiles (several per expert) and several column tiles."""
    x = randn(90, D, seed=12)
    logits = gemm.matmul(x, weights["router"], 0, torch.float32)
    ids, rw = moe.route(logits, weights["bias"], top_k=K, norm_topk_prob=True, scaling=2.5, n_real=90)
    gate, up, down = (moe.dense(weights[k]) for k in ("gate", "up", "down"))
    outs = []
    for group_m in (1, 2, 3, 1 << 20):
        out = torch.empty(1, 90, D, dtype=torch.float32, device=x.device)
        moe._experts_one_class(x, ids, rw, gate, up, down, LIMIT, moe.MoeTile(16, 16, 16, 4, 2, group_m), 1, out, 0)
        outs.append(out[0])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    torch.testing.assert_close(outs[0].cpu(), torch_moe(x, weights), **HALF_TOL)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_an_addend_is_added_after_the_sum_in_the_combine(weights: dict[str, torch.Tensor], rows: int) -> None:
    """`add` (the shared expert's partial when it runs apart, model/ffn.py) in the combine's launch: the bits of
    adding it to the experts' output afterwards, in both row classes; one laid out otherwise is refused."""
    x = randn(23, D, seed=31)
    logits = gemm.matmul(x, weights["router"], rows, torch.float32)
    ids, rw = moe.route(logits, weights["bias"], top_k=K, norm_topk_prob=True, scaling=2.5, n_real=23)
    args = (x, ids, rw, weights["gate"], weights["up"], weights["down"], LIMIT, rows)
    add = randn(1, 23, D, dtype=torch.float32, seed=32)
    assert torch.equal(moe.experts(*args, add=add), moe.experts(*args) + add)
    with pytest.raises(ValueError, match="laid out as the output"):
        moe.experts(*args, add=add[:, :, : D // 2])
