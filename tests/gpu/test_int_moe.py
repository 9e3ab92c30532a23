"""Integer experts on humming-kernels (kernels/gpu/int_moe.py) on the GPU, at GLM-5.3-Flash's expert shapes
(hidden 4096, experts 2048 wide, top-8 + the shared expert, TP 1's four virtual shards):

- against the torch twin (each pair's gate|up and down products over the dequantized weights in fp32, rounded to
  bf16 where the kernels round, SwiGLU, routing weights, the sum in pair order) on 32 + 1 experts;
- a row alone = the same row among 2 .. 2,048 rows, bit for bit, for both row classes, on all 288 + 1 experts;
- the two row classes' tiles give the same bits (the pinned configs differ only in their block rows / columns);
- a CUDA graph's replay = the eager call; an addend in the combine = added afterwards;
- a decode step's one routing launch that also groups and builds humming's tables (kernels/gpu/moe.py `route`
  with a `grouping`) = routing, grouping and tables apart, bit for bit; a row alone through it = among 2 .. 2,048
  rows; its graph replay = eager;
- a model of two real-dim layers (KDA + dense FFN, MLA + MoE) with int3 experts: a decode row's logits alone =
  among 2,048 rows, and a graph replay = the eager step.
Run with `-s` for the figures.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
CLASSES = {"decode": 1 << 30, "prefill": 0}
COMPANY = (2, 3, 8, 9, 16, 17, 64, 65, 100, 250, 700, 2048)
TOP_K, D, I, SHARDS, LIMIT, GROUP = 8, 4096, 2048, 4, 10.0, 128


def _needs_humming() -> None:
    from kernels.gpu import int_moe
    if not int_moe.available():
        pytest.skip("humming-kernels is not installed (pip install -e '.[gpu]')")


def _int(rows: int, k: int, bits: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    from kernels.quant import intn
    return intn.random_linear(rows, k, bits=bits, group=GROUP, std=0.02, generator=gen, device=DEV)


def _experts(n_exp: int, bits: int, seed: int) -> dict:
    """Random INT stacks in the layout model/ffn.py gives humming (gate|up [E+1, 2I, D], down [4 (E+1), D, I/4]),
    prepared; and their stored tensors for the twin."""
    from kernels.gpu import int_moe, wtiles
    gen = torch.Generator(device=DEV).manual_seed(seed)
    stored = {"gate_up": (_int((n_exp + 1) * 2 * I, D, bits, gen), (n_exp + 1, 2 * I, D)),
              "down": (_int(SHARDS * (n_exp + 1) * D, I // SHARDS, bits, gen), (SHARDS * (n_exp + 1), D, I // SHARDS))}
    args = {name: wtiles.quantized("int", {n: v.view(shape[0], shape[1], -1) for n, v in t.items()},
                                   {"bits": bits, "group": GROUP}) for name, (t, shape) in stored.items()}
    router = (torch.randn(n_exp, D, generator=gen, device=DEV) * 0.02).to(torch.bfloat16)
    return {"ie": int_moe.prepare(args["gate_up"], args["down"], SHARDS, torch.bfloat16), "stored": stored,
            "router": router, "bias": torch.zeros(n_exp, device=DEV), "bits": bits, "n_exp": n_exp}


@pytest.fixture(scope="module")
def small() -> dict:
    _needs_humming()
    return _experts(32, 3, seed=1)


@pytest.fixture(scope="module")
def release() -> dict:
    _needs_humming()
    return _experts(288, 3, seed=2)


def _route(x: torch.Tensor, w: dict, rows: int, n_real: int | torch.Tensor | None = None):
    from kernels.gpu import gemm, moe
    logits = gemm.matmul(x, w["router"], rows, torch.float32)
    return moe.route(logits, w["bias"], top_k=TOP_K, norm_topk_prob=True, scaling=2.5,
                     n_real=x.shape[0] if n_real is None else n_real)


def _moe(x: torch.Tensor, w: dict, rows: int, n_real: int | torch.Tensor | None = None) -> torch.Tensor:
    from kernels.gpu import moe
    ids, rw = _route(x, w, rows, n_real)
    return moe.experts(x, ids, rw, w["ie"], None, None, LIMIT, rows)


def _moe_grouped(x: torch.Tensor, w: dict, n_real: int | torch.Tensor | None = None) -> torch.Tensor:
    """A decode step as ops/fused.py runs it: the routing's launch also groups the pairs and builds humming's
    tables (kernels/gpu/moe.py `grouping`), when the step is decode-sized."""
    from kernels.gpu import gemm, moe
    rows = CLASSES["decode"]
    logits = gemm.matmul(x, w["router"], rows, torch.float32)
    g = moe.grouping(x, w["ie"], rows, SHARDS)
    ids, rw = moe.route(logits, w["bias"], top_k=TOP_K, norm_topk_prob=True, scaling=2.5,
                        n_real=x.shape[0] if n_real is None else n_real, grouping=g)
    return moe.experts(x, ids, rw, w["ie"], None, None, LIMIT, rows, grouping=g)


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV).to(torch.bfloat16)


def _placed(crowd: torch.Tensor, target: torch.Tensor, m: int) -> tuple[torch.Tensor, int]:
    at = m // 2
    return torch.cat([crowd[:at], target, crowd[at:m - 1]]), at


def twin(x: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor, w: dict) -> torch.Tensor:
    """[shards, T, D] fp32 by torch over the dequantized experts, pair by pair in expert order per row."""
    from kernels import moe as ref
    from kernels.quant import intn
    params = {"bits": w["bits"], "group": GROUP}

    def dense(name: str) -> torch.Tensor:
        t, shape = w["stored"][name]
        return intn.CODEC.dequantize(t, (shape[0] * shape[1], shape[2]), params).view(shape)
    gu_w, dn_w = dense("gate_up"), dense("down")
    e1 = w["n_exp"] + 1
    out = torch.zeros(SHARDS, x.shape[0], D, device=DEV)
    for e in torch.unique(ids).tolist():
        if e >= e1:
            continue
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        gu = (x[rows].float() @ gu_w[e].T).to(torch.bfloat16)
        h = ref.swiglu(gu[:, :I], gu[:, I:], LIMIT)
        for s in range(SHARDS):
            width = I // SHARDS
            y = (h[:, s * width:(s + 1) * width].float() @ dn_w[s * e1 + e].T).to(torch.bfloat16).float()
            out[s].index_add_(0, rows, y * rw[rows, slot].unsqueeze(-1))
    return out


def test_moe_matches_twin(small: dict) -> None:
    x = _rows(64, seed=3)
    for name, rows in CLASSES.items():
        ids, rw = _route(x, small, rows)
        got = _moe(x, small, rows)
        want = twin(x, ids, rw, small)
        d = got.double() - want.double()
        norm, mx = (d.norm() / want.double().norm()).item(), (d.abs().max() / want.double().abs().max()).item()
        print(f"\nint3 MoE {name}: vs twin normwise {norm:.2e}, max {mx:.2e}")
        assert norm <= 1e-2 and mx <= 3e-2


def test_the_combine_adds_an_addend_after_the_sum(small: dict) -> None:
    """`add` (the shared expert's partial when it runs apart, model/ffn.py) in the combine's launch: the bits of
    adding it to the experts' output afterwards, in both row classes."""
    from kernels.gpu import moe
    x = _rows(40, seed=6)
    add = torch.randn(SHARDS, 40, D, device=DEV)
    for rows in CLASSES.values():
        ids, rw = _route(x, small, rows)
        args = (x, ids, rw, small["ie"], None, None, LIMIT, rows)
        assert torch.equal(moe.experts(*args, add=add), moe.experts(*args) + add)


@pytest.mark.parametrize("rows", CLASSES.values(), ids=CLASSES.keys())
def test_row_alone_equals_row_among_2048(release: dict, rows: int) -> None:
    crowd, target = _rows(2048, seed=4), _rows(1, seed=5)
    alone = _moe(target, release, rows)[:, 0]
    changed = []
    for m in COMPANY:
        batch, at = _placed(crowd, target, m)
        row = _moe(batch, release, rows)[:, at]
        if not torch.equal(row, alone):
            changed.append((m, (row - alone).abs().max().item()))
    print(f"\nint3 MoE 288+1 experts {'decode' if rows else 'prefill'} rows: row alone vs among {COMPANY}: "
          f"{len(changed)} differ {changed}")
    assert not changed


@pytest.mark.parametrize("rows,n_real", [(1, 1), (7, 5), (64, 64), (200, 171)])
def test_the_routing_launchs_tables_give_the_same_bits(release: dict, rows: int, n_real: int) -> None:
    """The decode step's one routing launch (ids, weights, grouping and humming's tables) = routing, grouping and
    tables apart, bit for bit, padding rows included."""
    from kernels.gpu import gemm, int_moe, moe
    from kernels.gpu.moe_groups import group_pairs
    x = _rows(rows, seed=9)
    logits = gemm.matmul(x, release["router"], CLASSES["decode"], torch.float32)
    g = moe.grouping(x, release["ie"], CLASSES["decode"], SHARDS)
    ids, rw = moe.route(logits, release["bias"], top_k=TOP_K, norm_topk_prob=True, scaling=2.5, n_real=n_real,
                        grouping=g)
    want_ids, want_rw = moe.route(logits, release["bias"], top_k=TOP_K, norm_topk_prob=True, scaling=2.5,
                                  n_real=n_real)
    assert torch.equal(ids, want_ids) and torch.equal(rw.view(torch.int32), want_rw.view(torch.int32))
    n_exp = release["ie"].gate_up.experts
    groups = group_pairs(want_ids, n_exp, g.block_m)
    tab = int_moe.tables(groups, want_ids.numel(), n_exp, SHARDS)
    assert torch.equal(g.groups.pair_of_slot, groups.pair_of_slot)
    assert torch.equal(g.groups.expert_of_block, groups.expert_of_block)
    for name in ("gate_up_rows", "down_rows", "down_experts", "padded"):
        assert torch.equal(getattr(g.int_tables, name), getattr(tab, name)), name
    assert torch.equal(_moe_grouped(x, release, n_real), _moe(x, release, CLASSES["decode"], n_real))


def test_grouped_row_alone_equals_row_among_2048(release: dict) -> None:
    """A decode row through the routing's grouping launch alone = among 2 .. 2,048 rows (past
    moe_groups.FUSED_PAIRS pairs the routing and the grouping run apart: the same bits must come out)."""
    crowd, target = _rows(2048, seed=10), _rows(1, seed=11)
    alone = _moe_grouped(target, release)[:, 0]
    changed = []
    for m in COMPANY:
        batch, at = _placed(crowd, target, m)
        row = _moe_grouped(batch, release)[:, at]
        if not torch.equal(row, alone):
            changed.append((m, (row - alone).abs().max().item()))
    print(f"\nint3 MoE, the routing launch's grouping: row alone vs among {COMPANY}: {len(changed)} differ {changed}")
    assert not changed


def test_grouped_graph_replay_equals_eager(release: dict) -> None:
    x = _rows(8, seed=12)
    n_real = torch.tensor([6], dtype=torch.int32, device=DEV)
    _moe_grouped(x, release, n_real)  # compiles every kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _moe_grouped(x, release, n_real)
    x.copy_(_rows(8, seed=13))
    n_real.fill_(7)
    graph.replay()
    assert torch.equal(captured, _moe_grouped(x, release, n_real))


def test_row_classes_give_the_same_bits(release: dict) -> None:
    """The decode and prompt tiles differ in block rows and columns only: one warp-K tile, the same K order. (One
    routing for both: the router's GEMM has a schedule per class, whose logits may differ in their last bits.)"""
    from kernels.gpu import moe
    x = _rows(300, seed=6)
    ids, rw = _route(x, release, CLASSES["prefill"])
    decode, prompt = (moe.experts(x, ids, rw, release["ie"], None, None, LIMIT, rows) for rows in CLASSES.values())
    assert torch.equal(decode, prompt)


def test_graph_replay_equals_eager(release: dict) -> None:
    x = _rows(8, seed=7)
    n_real = torch.tensor([8], dtype=torch.int32, device=DEV)
    _moe(x, release, CLASSES["decode"], n_real)  # compiles every kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _moe(x, release, CLASSES["decode"], n_real)
    x.copy_(_rows(8, seed=8))
    graph.replay()
    assert torch.equal(captured, _moe(x, release, CLASSES["decode"], n_real))


@pytest.fixture(scope="module")
def model():
    _needs_humming()
    from bench.random_weights import bench_spec, build_model
    from model.quantize.select import Recipe
    m, _ = build_model(bench_spec(layers=2, layer_pattern="KM"), device=DEV, dtype=torch.bfloat16, seed=0,
                       recipe=Recipe.parse("int3+bf16"))
    return m


def test_model_with_int3_experts_decode_row_alone_equals_row_among_2048(model) -> None:
    from kernels.gpu.int_moe import IntExperts
    from tests.gpu import test_fast_path
    assert isinstance(model.layers[1].ffn.params.gate, IntExperts)
    test_fast_path.test_decode_row_alone_equals_row_among_2048(model)


def test_model_with_int3_experts_graph_replay_equals_eager(model) -> None:
    from tests.gpu import test_fast_path
    test_fast_path.test_graph_replay_equals_eager(model)
