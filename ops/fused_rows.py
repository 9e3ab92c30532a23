"""What the fused ops need to know about a batch's rows, as device tensors, built once per forward.

The reference ops read `Batch`'s Python lists; on a GPU that would mean host syncs and per-sequence launches.
`GpuRows` moves the row and sequence facts to the device once (one pinned host buffer, one copy), so the layers
launch a fixed set of kernels whatever the batch, and a CUDA graph can replay them with the same buffers refilled
(model/cuda_graphs.py builds a `GpuRows` over static buffers). Nothing here imports Triton.

Rows are ordered decode-class first (Batch.class_order): rows [0, decode_rows) are decode steps and verify windows,
the rest prompt chunks, so every kernel runs each class with its own fixed schedule on a contiguous run of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gpu import to_device
from kernels.gpu.seqs import DecodeSeqs
from model.batch import Batch

CONV_HISTORY = 3  # inputs a KDA slot keeps for its 4-tap short conv (the fused kernels handle 4 taps only)


@dataclass
class PromptSeqs:
    """The prompt chunks of a batch, for the chunked KDA kernel (one varlen call over all of them)."""
    seqs: list[int]  # batch sequence indices
    cu_seqlens: torch.Tensor  # int64 [P+1] row offsets relative to the first prompt row
    # the same offsets on the host: fla-core derives its chunk indices from them without a device sync (from the
    # device copy it reads a count back, which would hold the host until every round queued before this one ran)
    cu_seqlens_host: torch.Tensor
    slots: torch.Tensor  # int64 [P] KDA state slots
    fresh: torch.Tensor  # bool [P] starts at position 0
    # per prompt row (int32 [T_prompt]), for the short conv: its sequence's first prompt row, slot, fresh flag
    row_first: torch.Tensor
    row_slot: torch.Tensor
    row_fresh: torch.Tensor
    # the conv history each sequence keeps after its chunk, CONV_HISTORY rows a sequence ([P*3]): row m is the
    # chunk's input hist_row[m] (a prompt row) where hist_new[m], else row hist_old[m] of the P old histories'
    # rows stacked (zeros for a fresh sequence)
    hist_row: torch.Tensor
    hist_old: torch.Tensor
    hist_new: torch.Tensor


@dataclass
class GpuRows:
    n_rows: int  # real packed rows (graph padding rows come after them)
    decode_rows: int
    positions: torch.Tensor  # int32 [T] absolute position of every row
    row_seq: torch.Tensor  # int32 [T] sequence of every row
    tables: torch.Tensor  # int32 [B, W] block tables
    n_real: torch.Tensor  # int32 [1] rows that route through the experts (graph padding rows do not)
    kda: DecodeSeqs  # the decode-class sequences (decode steps and verify windows)
    verify: list[int]  # sequences that are verify windows
    verify_rows: list[int]  # each one's first packed row: where its rows' states go in the pending buffers
    prompt: PromptSeqs | None
    max_pools: int  # most complete k-pools any row sees (sizes the indexer's score matrix)
    # KDA layer -> (state, conv) pending buffers of at least `decode_rows` rows that outlive the forward (a rank's
    # CUDA graphs share one set); None: the forward allocates its own when it has verify windows
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


def _device(values: list[list[int] | torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Several int32 vectors (lists, or host tensors) to the device with one pinned host buffer and one
    asynchronous copy."""
    host = [v.to(torch.int32) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.int32) for v in values]
    dev = to_device(torch.cat(host), device)
    return list(torch.split(dev, [h.numel() for h in host]))


def build(batch: Batch, *, kpool: int) -> GpuRows:
    """GpuRows of an eager forward (decode-class sequences must come first: Batch.permuted). The per-row vectors
    are built with torch on the host, not Python lists: a list per prompt row and one torch.tensor over them took
    over ten times as long at an 8,192-row chunk, while the GPU waits for the forward's first kernel
    (docs/benchmarks.md, "Host work")."""
    dev = batch.token_ids.device
    decode_rows = batch.decode_rows
    offsets = batch.offsets
    decode = [s for s in range(batch.num_seqs) if not batch.is_prompt(s)]
    verify = [s for s in decode if batch.is_verify(s)]
    prompt = [s for s in range(batch.num_seqs) if batch.is_prompt(s)]
    pending = [offsets[s] if s in verify else -1 for s in decode]
    p_len = torch.tensor([batch.lengths[s] for s in prompt], dtype=torch.int64)
    cu_t = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(p_len, 0)])
    cu = cu_t.tolist()
    p_slots = [batch.slots[s] for s in prompt]
    p_fresh = [int(batch.starts[s] == 0) for s in prompt]
    hist_row: list[int] = []
    hist_old: list[int] = []
    hist_new: list[int] = []
    for i, s in enumerate(prompt):
        n = batch.lengths[s]
        for m in range(CONV_HISTORY):  # the last CONV_HISTORY inputs of history + chunk, oldest first
            src = n - CONV_HISTORY + m
            hist_row.append(cu[i] + max(src, 0))
            hist_old.append(i * CONV_HISTORY + min(n + m, CONV_HISTORY - 1))
            hist_new.append(int(src >= 0))
    # host tensors all (the sizes given, so nothing here could wait for a device either)
    per_row = lambda v: torch.repeat_interleave(torch.tensor(v, dtype=torch.int64), p_len,  # noqa: E731
                                                output_size=cu[-1])
    rows = batch.token_ids.numel()
    (pos_t, seq_t, row0, length, slot, fresh, pend, n_real, cu_d, p_slots_t, p_fresh_t, r_first, r_slot,
     r_fresh, h_row, h_old, h_new) = _device([
        batch.host_positions(), batch.host_row_seq(),
        [offsets[s] for s in decode], [batch.lengths[s] for s in decode],
        [batch.slots[s] for s in decode], [int(batch.starts[s] == 0) for s in decode], pending,
        [rows], cu_t, p_slots, p_fresh,
        per_row(cu[:-1]), per_row(p_slots), per_row(p_fresh), hist_row, hist_old, hist_new], dev)
    kda = DecodeSeqs(row0, length, slot, fresh, pend)
    prompt_seqs = PromptSeqs(prompt, cu_d.long(), cu_t, p_slots_t.long(), p_fresh_t.bool(), r_first, r_slot,
                             r_fresh, h_row.long(), h_old.long(), h_new.bool()) if prompt else None
    ends = [st + n for st, n in zip(batch.starts, batch.lengths)]
    return GpuRows(n_rows=rows, decode_rows=decode_rows, positions=pos_t, row_seq=seq_t,
                   tables=batch.block_tables.to(torch.int32), n_real=n_real, kda=kda, verify=verify,
                   verify_rows=[offsets[s] for s in verify], prompt=prompt_seqs, max_pools=max(ends) // kpool)
