"""The hand-written CUDA EXL3 grouped product (kernels/gpu/exl3_cuda.py): decoded tiles equal the torch twin's bit for
bit, products match the twin's within float32 rounding, a row's bits never depend on its company, a CUDA-graph replay
equals the eager call, and the MoE and GEMM paths that use it agree with the Triton kernel they replace."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (codebook, bits): every rate the extension is built for in mul1, whole rates in the other two
RATES = [("mul1", 2.0), ("mul1", 2.5), ("mul1", 3.0), ("mul1", 3.5), ("mul1", 4.0), ("mcg", 3.0), ("3inst", 2.0),
         ("3inst", 4.0)]


def stack(experts: int, n: int, k: int, bits: float, codebook: str, seed: int):
    """EXL3 weights of `experts` random [n, k] linears as the kernels read them, and each one's decoded tiles."""
    from kernels.gpu import wtiles
    from kernels.quant import exl3
    g = torch.Generator().manual_seed(seed)
    parts = [exl3.random_linear(n, k, std=0.05, bits=bits, codebook_name=codebook, generator=g)
             for _ in range(experts)]
    tensors = {name: torch.stack([p[name] for p in parts]).cuda() for name in ("trellis", "suh", "svh")}
    w = wtiles.quantized("exl3", tensors, {"codebook": codebook})
    return w, torch.stack([exl3.decode_tiles(p["trellis"], codebook) for p in parts]).cuda()


def grouped(a: torch.Tensor, w, expert_of_tile: list[int], pairs: torch.Tensor) -> torch.Tensor:
    from kernels.gpu import exl3_cuda
    assert exl3_cuda.covers(a, w, exl3_cuda.BLOCK_M)
    experts = torch.tensor(expert_of_tile, dtype=torch.int32, device="cuda")
    return exl3_cuda.grouped(a, w, pairs.to(torch.int32).cuda(), experts)


@pytest.mark.parametrize("codebook,bits", RATES)
def test_decoded_tiles_are_the_twins_bit_for_bit(codebook: str, bits: float) -> None:
    # One-hot rows pick single rows of T: every output is one decoded value plus zeros, exact in float32.
    n, k = 128, 512
    w, tiles = stack(1, n, k, bits, codebook, seed=1)
    a = torch.eye(k, dtype=torch.float16, device="cuda")
    got = grouped(a, w, [0] * (k // 16), torch.arange(k))
    assert torch.equal(got, tiles[0]), f"{(got - tiles[0]).abs().max()} off"


@pytest.mark.parametrize("codebook,bits", [("mul1", 2.5), ("mcg", 3.0)])
def test_products_match_the_twin(codebook: str, bits: float) -> None:
    n, k, experts = 256, 512, 3
    w, tiles = stack(experts, n, k, bits, codebook, seed=2)
    # tiles of experts 2, 0, 1 and an unused one (sentinel: never written); some slots empty
    pairs = torch.arange(64)
    pairs[[3, 17, 18, 40]] = -1
    a = torch.randn(64, k, device="cuda").to(torch.float16)
    got = grouped(a, w, [2, 0, 1, experts], pairs)
    for tile, e in enumerate([2, 0, 1]):
        rows = slice(16 * tile, 16 * tile + 16)
        want = a[rows].float() @ tiles[e]
        want[pairs[rows] < 0] = 0.0  # empty slots read zeros
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-4)


def test_a_row_alone_equals_the_row_in_company() -> None:
    from kernels.gpu import exl3_cuda
    n, k = 128, 1024
    w, _ = stack(2, n, k, 3.0, "mul1", seed=3)
    crowd = torch.randn(64, k, device="cuda").to(torch.float16)
    alone_pairs = torch.full((16,), -1)
    alone_pairs[5] = 5
    alone = grouped(crowd[:16], w, [1], alone_pairs)[5]  # crowd[5] times expert 1, the only row of its tile
    full = grouped(crowd[:16], w, [1], torch.arange(16))[5]
    others = torch.cat([crowd[16:32], crowd[:16], crowd[32:]])  # crowd[5] at slot 21, in the second of 4 tiles
    many = grouped(others, w, [0, 1, 0, 1], torch.arange(64))[21]
    dense = exl3_cuda.dense(torch.stack([crowd[16:32], crowd[:16]]), w)[1, 5]  # rows per weight, no slot table
    for name, row in (("a full tile", full), ("four tiles", many), ("the dense call", dense)):
        assert torch.equal(row, alone), f"the row changed in {name}"


def test_the_pair_launch_equals_two_single_launches() -> None:
    """The MoE's gate and up in one launch (grid z picks the stack): each half is its single launch, bit for bit."""
    from kernels.gpu import exl3_cuda
    n, k = 128, 1024
    gate, _ = stack(3, n, k, 2.5, "mul1", seed=6)
    up, _ = stack(3, n, k, 2.5, "mul1", seed=7)
    assert exl3_cuda.pairs_with(gate, up)
    pairs = torch.arange(48, dtype=torch.int32, device="cuda")
    pairs[[2, 30]] = -1
    experts = torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda")  # the last tile unused (sentinel)
    a = torch.randn(96, k, device="cuda").to(torch.float16)
    both = exl3_cuda.grouped_pair(a, gate, up, pairs, experts)
    assert torch.equal(both[:32], exl3_cuda.grouped(a[:48], gate, pairs, experts)[:32])
    assert torch.equal(both[48:80], exl3_cuda.grouped(a[48:], up, pairs, experts)[:32])


def test_graph_replay_equals_eager() -> None:
    from kernels.gpu import exl3_cuda
    n, k = 128, 512
    w, _ = stack(2, n, k, 2.5, "mul1", seed=4)
    a = torch.randn(32, k, device="cuda").to(torch.float16)
    pairs = torch.arange(32, dtype=torch.int32, device="cuda")
    experts = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    eager = exl3_cuda.grouped(a, w, pairs, experts)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = exl3_cuda.grouped(a, w, pairs, experts)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("path", ["moe", "gemm"])
def test_the_paths_that_use_it_agree_with_the_triton_kernel(path: str, monkeypatch) -> None:
    """moe.experts and gemm.matmul with EXL3 weights on decode-class rows, CUDA product against the Triton one it
    replaces: the same values within float32 summation order (their K orders differ), each row still alone = among
    others."""
    from kernels.gpu import gemm, moe
    d, i, experts = 512, 512, 5
    x = torch.randn(7, d, device="cuda").to(torch.bfloat16)
    if path == "moe":
        gate, _ = stack(experts, i, d, 3.0, "mul1", seed=5)
        up, _ = stack(experts, i, d, 3.0, "mul1", seed=6)
        down, _ = stack(experts, d, i, 3.0, "mul1", seed=7)
        ids = torch.tensor([[0, 2, 4], [1, 3, 4], [0, 1, 4], [2, 3, 4], [0, 3, 4], [1, 2, 4], [0, 2, 4]],
                           dtype=torch.int32, device="cuda")
        rw = torch.rand(7, 3, device="cuda")

        def run(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
            return moe.experts(rows, ids[:n_rows], rw[:n_rows], gate, up, down, 10.0, n_rows)[0]
    else:
        w, _ = stack(1, 1024, d, 4.0, "mul1", seed=8)

        def run(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
            return gemm.matmul(rows, w, n_rows, torch.float32)
    cuda = run(x, 7)
    assert torch.equal(run(x[:1], 1)[0], cuda[0]), "row 0 changed beside 6 others"
    monkeypatch.setenv("TWINSPARK_EXL3_KERNEL", "triton")
    triton_out = run(x, 7)
    assert not torch.equal(cuda, triton_out), "the CUDA product did not run (same bits as Triton's)"
    torch.testing.assert_close(cuda, triton_out, rtol=2e-2, atol=2e-2)


def test_prompt_rows_take_the_cuda_product_too() -> None:
    """EXL3 experts' prompt rows run the CUDA product's 16-slot tiles as decode rows do (moe._tile): a row's bits
    are the same in either class, and alone or among others."""
    from kernels.gpu import moe
    d, i, experts = 512, 512, 5
    gate, _ = stack(experts, i, d, 2.5, "mul1", seed=9)
    up, _ = stack(experts, i, d, 2.5, "mul1", seed=10)
    down, _ = stack(experts, d, i, 2.5, "mul1", seed=11)
    x = torch.randn(40, d, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts - 1)[:2].sort().values for _ in range(40)])
    ids = torch.cat([ids, torch.full((40, 1), experts - 1)], dim=1).to(torch.int32).cuda()
    rw = torch.rand(40, 3, device="cuda")
    prompt = moe.experts(x, ids, rw, gate, up, down, 10.0, 0)
    decode = moe.experts(x, ids, rw, gate, up, down, 10.0, 40)
    mixed = moe.experts(x, ids, rw, gate, up, down, 10.0, 13)
    assert torch.equal(prompt, decode) and torch.equal(mixed, decode)
    assert torch.equal(moe.experts(x[7:8], ids[7:8], rw[7:8], gate, up, down, 10.0, 0)[:, 0], decode[:, 7])
