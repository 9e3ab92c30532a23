"""Causal MLA attention in the expanded form, for prompt rows whose DSA selection holds their whole context.

The latent form (kernels/gpu/mla.py) attends over the cached latent rows with 512-wide queries and outputs: per
(row, position, head) it multiplies 2 x 512 twice, against 2 x (256 + 256) for attention over the per-head keys and
values k = W_uk c, v = W_uv c. Decode rows read a few latent rows each and need the latent form (expanding the
context per head would cost far more than it saves); a prompt chunk attends every row to every earlier position,
so expanding its context once (one product, as wide as folding W_uk into its queries and W_uv into its outputs)
halves its attention FLOPs. That holds while a row's DSA selection is its whole context: below
`index_topk + kpool - 1` positions, where every k-pool a row sees fits the selection (an 8k prompt at the release's
2,048 x 4). Rows past it keep the latent form over their selection.

Torch twin: kernels/mla.py `expanded_attention`. The schedule follows docs/design.md §5.1: a program owns BM
consecutive rows of one sequence and one head, and walks that sequence's keys in BN-wide blocks from position 0
with an fp32 online softmax; a block past a row's own position adds exact zeros to it, so a row's bits depend on
its position only, never on which rows share its program, its chunk or its launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import arch as gpu_arch, pdl
from kernels.gpu.pdl import wait_for_inputs

# Rows per program (the M side of the tensor-core tiles), keys per step, warps, pipeline stages.
# `python -m bench.kernels --only mlaxsweep` times the choices on an 8k prompt.
TILE: dict[str, int] = dict(BM=64, BN=64, num_warps=8, num_stages=2)
# GB10's row (kernels/gpu/arch.py): two stages need 104 KiB of shared memory, one 72 KiB (GB10 has 99 KiB a block;
# bench.kernel_census). One stage keeps Hopper's tile, so its bits: only the loads are no longer pipelined. BM is
# the host's tile plan (ops/expanded_rows.py), the same in every row. Not timed on a GB10 yet.
TILE_GB10: dict[str, int] = dict(BM=64, BN=64, num_warps=8, num_stages=1)


def tile_for(arch: int) -> dict[str, int]:
    """The tile on the architecture's table row (read at call time: bench.kernels sweeps TILE)."""
    return TILE if arch == gpu_arch.HOPPER else TILE_GB10


# The tile table may sit anywhere in a shared host-to-device buffer: its alignment is not specialised on (one build).
@triton.jit(do_not_specialize_on_alignment=["tiles_ptr"])
def _expanded_kernel(q_ptr, s_qh, s_qt, kv_ptr, s_kh, s_kt, out_ptr, s_oh, s_ot, tiles_ptr, scale,
                     DN: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr = False):
    """Tile `program_id(0)` = (first row, rows, the first row's position, the row of the sequence's position 0 in
    kv); head `program_id(1)`. Row i of the tile attends to its sequence's keys 0 .. position + i."""
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    row0 = tl.load(tiles_ptr + tile * 4)
    n = tl.load(tiles_ptr + tile * 4 + 1)
    pos0 = tl.load(tiles_ptr + tile * 4 + 2)
    key0 = tl.load(tiles_ptr + tile * 4 + 3).to(tl.int64)
    act = q_ptr.dtype.element_ty
    i = tl.arange(0, BM)
    live = i < n
    rows = (row0 + i).to(tl.int64)
    pos = pos0 + i
    cn = tl.arange(0, DN)
    cv = tl.arange(0, DV)
    q = tl.load(q_ptr + h * s_qh + rows[:, None] * s_qt + cn[None, :], mask=live[:, None], other=0.0)
    m = tl.full((BM,), -1.0e30, tl.float32)  # finite start: a block with nothing visible adds exp(-inf) = 0
    l = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, DV), tl.float32)
    hi = pos0 + n  # keys 0 .. the tile's last position
    j = tl.arange(0, BN)
    for b in range(0, hi, BN):
        key = b + j
        ok = key < hi
        at = kv_ptr + h * s_kh + (key0 + key)[:, None] * s_kt
        k = tl.load(at + cn[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(prob, axis=1)
        v = tl.load(at + DN + cv[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(act), v)
        m = m_new
    o = acc / l[:, None]
    tl.store(out_ptr + h * s_oh + rows[:, None] * s_ot + cv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=live[:, None])


def attend(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, tiles: torch.Tensor, scale: float,
           tile: dict[str, int] | None = None) -> None:
    """q [H, T, dn] (unit last stride); kv [H, L, dn + dv] (each head's keys then values, unit last stride: the
    decompressed context of the tiles' sequences); out [H, T, dv]; tiles int32 [n, 4] rows of (first row,
    rows <= BM, first row's position, kv row of the sequence's position 0) -> out's tiled rows, every head."""
    cfg = dict(tile or tile_for(gpu_arch.row(q.device)))
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    heads, _, dn = q.shape
    dv = out.shape[-1]
    if kv.shape[-1] != dn + dv or kv.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"attend: q {list(q.shape)}, kv {list(kv.shape)}, out {list(out.shape)} do not fit")
    if tiles.shape[0] == 0:
        return
    _expanded_kernel[(tiles.shape[0], heads)](q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), out,
                                               out.stride(0), out.stride(1), tiles, float(scale), DN=dn, DV=dv,
                                               BM=bm, BN=bn, **cfg, **pdl.options())
