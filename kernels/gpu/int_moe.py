"""Integer group-quantized experts (kernels/quant/intn.py: 2, 3, 4 or 8 bits, a bf16 scale per group) on
humming-kernels' indexed MoE GEMM, vLLM's JIT low-bit kernels: a few integer instructions decode several weights
in registers and feed the tensor cores, where the EXL3 trellis decode is bound by integer work (the figures:
docs/quantization.md, "Integer formats on the GPU").

Why humming and not our own Triton tile: Triton's per-element decode of a bit stream (wtiles.int_tile, the portable
path) costs several integer operations per weight; humming's decode works on whole registers of packed codes.

Exactness (docs/design.md §5.1): humming's batch-invariant mode keeps one warp-K tile per block and no stream-K, so
an output element is one chain of tensor-core steps over K in ascending order, whatever the tile's rows or
columns; its tile configuration is pinned here per row class (`tile`), never chosen by the row count. Configs that
differ only in their block rows and columns give the same bits (at GLM-5.3-Flash's expert shapes, wgmma and
mma.sync configs alike: docs/quantization.md), which tests/gpu/test_int_moe.py keeps checking, with a row alone =
among 2..2,048 rows.

One MoE step for one row class, five launches after the grouping (kernels/gpu/moe_groups.py), four when the
routing's launch built the grouping and the tables (a decode step: kernels/gpu/moe.py `route`, `table_rows`):
1. `tables`: humming's row tables (vLLM's moe_align layout) from the grouping: gate|up's, and down's — the gate|up
   grid copied once per local virtual shard (shard s's pair rows s * pairs + p, its experts s * (E + 1) + e),
   packed so the used blocks of all shards come first — and each grid's padded row count (humming reads it on the
   device: nothing syncs with the host);
2. gate|up: every (token, expert) pair's [2 I] row, one launch for all local shards (x's rows, top_k = pairs per
   row);
3. the clamped SwiGLU (kernels/gpu/swiglu.py) writes h shard-major, [shards, pairs, I / shards];
4. down: every shard's pairs in one launch over the shards' stacked experts;
5. the combine (kernels/gpu/moe.py): each row's pair outputs times their routing weights, added in pair order.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.gpu import arch as gpu_arch, pdl
from kernels.gpu.gemm import RowClass
from kernels.gpu.moe_groups import Groups, group_pairs
from kernels.gpu.pdl import wait_for_inputs
from kernels.gpu.swiglu import swiglu
from kernels.gpu.wtiles import Fmt, WeightArgs

BITS = frozenset({2, 3, 4, 8})
BLOCK_K = 64  # the one K tile of every pinned config (= warp K: wgmma's widest bf16 swizzle)


@dataclass(frozen=True)
class Tile:
    """A humming tuning config, pinned per row class and architecture: block [M, N, K] with warps of [M, warp_n, K]
    (one warp-K tile), `stages` pipeline stages, `ctas` resident blocks per SM, `mma` the tensor-core instruction."""
    block_m: int
    block_n: int
    warp_n: int
    stages: int
    ctas: int
    mma: str

    def config(self) -> dict:
        return {"block_shape": [self.block_m, self.block_n, BLOCK_K],
                "warp_shape": [self.block_m, self.warp_n, BLOCK_K],
                "mma_type": self.mma, "num_stages": self.stages, "num_ctas_per_sm": self.ctas,
                "use_stream_k": False, "use_warp_spec": False, "use_tma": False, "use_batch_invariant": True}


def tile(rows: RowClass, arch: int) -> Tile:
    """The pinned config. Decode rows: 8-row blocks of 256 columns, 8 stages, two blocks an SM — the best of 34
    batch-invariant configs swept at 8 and 32 rows for 3-bit gate|up and down (more stages and two resident blocks
    keep more weight bytes in flight than the library's own invariant choice; docs/quantization.md has the
    figures; bench.kernels' intsweep sweeps again). Prompt rows: 64-row blocks (not swept yet). `arch` is the GPU's table row
    (kernels/gpu/arch.py): Hopper runs wgmma; GB10 (no wgmma) the warp-level mma with 128-column blocks, untimed."""
    prompt = rows is RowClass.PREFILL
    if arch == gpu_arch.HOPPER:
        return Tile(64, 256, 32, 4, 1, "wgmma") if prompt else Tile(8, 256, 32, 8, 2, "wgmma")
    return Tile(64, 128, 32, 3, 1, "mma") if prompt else Tile(16, 128, 32, 4, 2, "mma")


@lru_cache(maxsize=1)
def load_humming():
    """humming-kernels, imported on first use (a CPU install has none), its kernel cache beside twinspark's CUDA
    builds unless HUMMING_CACHE_DIR says otherwise: a rank compiles every config in its warm-up and a second start
    loads them (docs/gpu-engine.md)."""
    os.environ.setdefault("HUMMING_CACHE_DIR", str(Path.home() / ".cache" / "twinspark" / "humming"))
    import humming  # noqa: F401  (registers its ops)
    return humming


def available() -> bool:
    try:
        load_humming()
    except ImportError:
        return False
    return True


@dataclass
class Stack:
    """One projection's experts in humming's layout for this GPU: the layer config and the repacked tensors."""
    layer: str  # humming's LayerConfig as JSON (shape, dtypes, group, experts)
    weight: torch.Tensor
    scale: torch.Tensor
    n: int
    k: int
    experts: int


@dataclass
class IntExperts:
    """A MoE's routed (+ shared) experts prepared for humming: gate|up [E + 1, 2 I_local, D] (gate's I_local rows,
    then up's, the local shards' slices side by side in each) and down [shards x (E + 1), D, I_local / shards]."""
    gate_up: Stack
    down: Stack
    shards: int


def covers(gate: WeightArgs, up: WeightArgs, down: WeightArgs, dtype: torch.dtype) -> bool:
    """Whether these expert stacks (one virtual shard's, or all local ones) run on humming: INT stacks of one bit
    width and group, bf16 / fp16 rows on CUDA, every product whole tiles of its pinned configs (N a multiple of
    256, K of 64 and of the group), and humming installed."""
    ws = (gate, up, down)
    if any(w.fmt is not Fmt.INT for w in ws) or not gate.data.is_cuda or dtype not in (torch.bfloat16, torch.float16):
        return False
    bits, group = gate.block_n, gate.block_k
    if bits not in BITS or group % 32 or any((w.block_n, w.block_k) != (bits, group) for w in ws):
        return False
    fits = all(w.k % BLOCK_K == 0 and w.k % group == 0 for w in ws) and gate.n == up.n \
        and (2 * gate.n) % 256 == 0 and down.n % 256 == 0
    return fits and available()


def _stack(data: torch.Tensor, scale: torch.Tensor, bits: int, group: int, dtype: torch.dtype) -> Stack:
    """Repack stored INT experts ([E, N, K * bits / 32] words of q + 2^(bits-1), [E, N, K / group] scales) into
    humming's layout for the GPU at hand. The stored codes are humming's unsigned codes with the midpoint as the
    zero (its `uint<bits>` weight type), so only the tile layout changes."""
    load_humming()
    from humming.schema import HummingWeightSchema
    from humming.transform import prepare_layer_config, transform_humming_tensors

    experts, n, words = data.shape
    k = words * 32 // bits
    schema = HummingWeightSchema(b_dtype=f"uint{bits}", bs_dtype="bfloat16", weight_scale_group_size=group)
    tensors = {"weight": data.contiguous(), "weight_scale": scale.to(torch.bfloat16).contiguous()}
    config = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema, num_experts=experts, torch_dtype=dtype,
                                  device=data.device, tensors=tensors)
    out = transform_humming_tensors(config, tensors)
    return Stack(config.to_str(), out["weight"], out["weight_scale"], n, k, experts)


def prepare(gate_up: WeightArgs, down: WeightArgs, shards: int, dtype: torch.dtype) -> IntExperts:
    """The stacks in humming's layout (`covers` holds): gate_up [E + 1, 2 I_local, D] (gate's rows, then up's),
    down [shards x (E + 1), D, I_local / shards]."""
    bits, group = gate_up.block_n, gate_up.block_k
    return IntExperts(_stack(gate_up.data, gate_up.scale, bits, group, dtype),
                      _stack(down.data, down.scale, bits, group, dtype), shards)


_COMPUTE = json.dumps({"gemm_type": "indexed", "use_batch_invariant": True})


@lru_cache(maxsize=None)
def build(layer: str, compute: str, t: Tile, device: int) -> torch.Tensor:
    """The compiled kernel of `layer` for `compute` (humming's gemm type, batch invariant) at tile `t` (humming's
    [0, 2^30) row range: every row count runs it), built on first use — the rank's warm-up or load — or loaded from
    humming's cache."""
    load_humming()
    from humming.kernel.humming import HummingKernel
    return HummingKernel.prepare_kernels(layer, compute, json.dumps([[0, 1 << 30, t.config()]]), device=device)


def kernels(layer: str, t: Tile, device: int) -> torch.Tensor:
    """The indexed MoE GEMM's kernel of `layer` at tile `t` (`build`)."""
    return build(layer, _COMPUTE, t, device)


def _product(stack: Stack, x: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
             padded: torch.Tensor, top_k: int, t: Tile) -> None:
    """out[pair] = x[pair // top_k] @ W[expert of the pair's block]^T (bf16) for every pair the tables list."""
    load_humming().ops.launch_kernel(configs=kernels(stack.layer, t, x.device.index or 0), inputs=x,
                                 weight=stack.weight, weight_scale=stack.scale, outputs=out, sorted_ids=sorted_ids,
                                 expert_ids=expert_ids, num_tokens_padded=padded, top_k=top_k)


@triton.jit
def table_rows(r, used, pair_ptr, expert_ptr, gu_ptr, dn_ptr, block_ptr, blocks, n_pairs, experts, shards,
               BLOCK_M: tl.constexpr):
    """Rows `r` of humming's row tables from the grouping (moe_groups.Groups), whose first `used` tiles hold pairs:
    gate|up's slots with its "no row" mark (the pair count, vLLM's convention) for empty ones; the down grid =
    shard s's copy of gate|up's used blocks right after shard s - 1's (slot s * used_slots + i holds pair
    p + s * n_pairs, block s * used + b reads expert s * experts + e; "no row" = shards * n_pairs). The body of
    `_tables`, and of the routing launch that builds them itself (kernels/gpu/moe.py)."""
    used_slots = used * BLOCK_M
    cap = blocks * BLOCK_M
    own = tl.load(pair_ptr + r, mask=r < cap, other=-1)
    tl.store(gu_ptr + r, tl.where(own >= 0, own, n_pairs), mask=r < cap)
    span = tl.maximum(used_slots, 1)
    s = r // span
    live = s < shards
    pair = tl.load(pair_ptr + r % span, mask=live, other=-1)
    tl.store(dn_ptr + r, tl.where(live & (pair >= 0), pair + s * n_pairs, shards * n_pairs), mask=r < shards * cap)
    rb = r // BLOCK_M  # the first slot of each block also writes the block's expert
    first = (r % BLOCK_M == 0) & (r < shards * cap)
    sb = rb // tl.maximum(used, 1)
    e = tl.load(expert_ptr + rb % tl.maximum(used, 1), mask=first & (sb < shards), other=0)
    tl.store(block_ptr + rb, tl.where(sb < shards, e + sb * experts, 0), mask=first)


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["blocks", "n_pairs"])
def _tables(pair_ptr, expert_ptr, gu_ptr, dn_ptr, block_ptr, padded_ptr, blocks, n_pairs, experts, shards,
            BLOCK_M: tl.constexpr, BLOCKS_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """`table_rows` over the grid, a chunk per program; padded = [gate|up's used slots, shards times that]."""
    wait_for_inputs(PDL)
    b = tl.arange(0, BLOCKS_P2)
    used = tl.sum((tl.load(expert_ptr + b, mask=b < blocks, other=experts) < experts).to(tl.int32), axis=0)
    if tl.program_id(0) == 0:
        tl.store(padded_ptr, used * BLOCK_M)
        tl.store(padded_ptr + 1, used * BLOCK_M * shards)
    table_rows(tl.program_id(0) * CHUNK + tl.arange(0, CHUNK), used, pair_ptr, expert_ptr, gu_ptr, dn_ptr, block_ptr,
               blocks, n_pairs, experts, shards, BLOCK_M)


@dataclass
class Tables:
    """humming's indexed-GEMM tables of one MoE step (device tensors; see `table_rows`)."""
    gate_up_rows: torch.Tensor  # [cap] int32: each slot's pair, n_pairs for an empty slot
    gate_up_experts: torch.Tensor  # [blocks] int32 (the grouping's; entries past the used blocks are never read)
    down_rows: torch.Tensor  # [shards * cap] int32
    down_experts: torch.Tensor  # [shards * blocks] int32
    padded: torch.Tensor  # [2] int32: used slots of gate|up, of down


def empty_tables(groups: Groups, shards: int) -> Tables:
    """`Tables`' tensors, unset (gate|up's experts: the grouping's own), for `groups`."""
    dev = groups.pair_of_slot.device
    cap = groups.pair_of_slot.shape[0]

    def table(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int32, device=dev)
    return Tables(table(cap), groups.expert_of_block, table(shards * cap), table(shards * groups.blocks), table(2))


def tables(groups: Groups, n_pairs: int, experts: int, shards: int) -> Tables:
    blocks = groups.blocks
    cap = groups.pair_of_slot.shape[0]
    tab = empty_tables(groups, shards)
    chunk = 1024
    _tables[(triton.cdiv(shards * cap, chunk),)](
        groups.pair_of_slot, groups.expert_of_block, tab.gate_up_rows, tab.down_rows, tab.down_experts, tab.padded,
        blocks, n_pairs, experts, shards, BLOCK_M=cap // blocks, BLOCKS_P2=triton.next_power_of_2(blocks),
        CHUNK=chunk, **pdl.options())
    return tab


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ie: IntExperts, limit: float,
            rows: RowClass, out: torch.Tensor, row0: int, pinned: Tile | None = None, tab: Tables | None = None,
            add: torch.Tensor | None = None) -> None:
    """One row class's rows x [T, D] (ids, weights [T, P] from moe.route) -> out[:, row0 : row0 + T] (every local
    shard's fp32 partial). pinned: another tile than the class's (bench.kernels' sweeps only). tab: these ids'
    tables for the class's tile, when the routing launch built them (moe.route's `grouping`); ignored with
    `pinned`, whose tile may group otherwise. add: what the combine adds after the experts' sum (moe.experts)."""
    from kernels.gpu.moe import combine

    t = pinned or tile(rows, gpu_arch.row(x.device))
    n_exp = ie.gate_up.experts
    pairs_per_row = ids.shape[1]
    n_pairs = ids.numel()
    if tab is None or pinned is not None:
        tab = tables(group_pairs(ids, n_exp, t.block_m), n_pairs, n_exp, ie.shards)
    gu = torch.empty(n_pairs, ie.gate_up.n, dtype=x.dtype, device=x.device)
    _product(ie.gate_up, x, gu, tab.gate_up_rows, tab.gate_up_experts, tab.padded[:1], pairs_per_row, t)
    i_local = ie.gate_up.n // 2
    width = i_local // ie.shards

    def per_shard(half: torch.Tensor) -> torch.Tensor:  # [pairs, I_local] -> [shards, pairs, I_local / shards] view
        return half.view(n_pairs, ie.shards, width).transpose(0, 1)
    h = swiglu(per_shard(gu[:, :i_local]), per_shard(gu[:, i_local:]), limit)
    y = torch.empty(ie.shards * n_pairs, ie.down.n, dtype=x.dtype, device=x.device)
    _product(ie.down, h.view(ie.shards * n_pairs, width), y, tab.down_rows, tab.down_experts, tab.padded[1:], 1, t)
    combine(y, ids, out, n_exp, row0, weights=weights, add=add)
