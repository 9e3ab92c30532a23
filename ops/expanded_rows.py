"""Which rows of a batch attend in MLA's expanded form, and the tables its launches read (kernels/gpu/mla_expanded.py).

A prompt row below `until` (the first position whose DSA selection can drop a position) attends to its whole
context, and the expanded form costs it half the latent form's FLOPs. Which form a row takes is a function of its
class and position only (docs/design.md §5.1), never of the chunk it comes in: a prompt row stays in the form it
would have alone, whatever the step's budget cut. Everything here is built on the host from the batch's lists and
copied once, so nothing waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gpu import to_device
from model.batch import Batch

# Keys decompressed per launch at most (each is heads x (dn + dv) values: at 64 heads of 256 + 256 in bf16, 64 KiB).
# Sequences are grouped up to this many; one longer sequence is a group of its own.
MAX_KEYS = 8192


@dataclass
class ExpandedGroup:
    # int32 [n, 4], one row per tile: (first packed row, rows, the first row's position, kv row of the sequence's
    # position 0); tiles with more keys come first, so the longest programs start first
    tiles: torch.Tensor
    key_rows: torch.Tensor  # int64 [L] each key's row (block * block_size + offset) in a flat view of the store


@dataclass
class ExpandedRows:
    groups: list[ExpandedGroup]
    # rows attended in the latent form: the first n rows when an int, else their indices (device int64, ascending)
    latent_rows: int | torch.Tensor


def plan(batch: Batch, tables: torch.Tensor, until: int, block_size: int, bm: int,
         max_keys: int = MAX_KEYS) -> ExpandedRows | None:
    """The batch's expanded-form rows in tiles of at most `bm` rows of one sequence, grouped by sequence up to
    `max_keys` keys a group (every key of a group's sequences up to its last such row), or None when there are none.
    tables: the batch's block tables on the device."""
    dev = batch.token_ids.device
    seqs: list[tuple[int, int, int, int]] = []  # (sequence, first row, rows, first position)
    latent = [(0, batch.decode_rows)]  # [lo, hi) runs of latent-form rows
    for s, (off, start, n) in enumerate(zip(batch.offsets, batch.starts, batch.lengths)):
        if not batch.is_prompt(s):
            continue
        c = min(n, max(0, until - start))
        if c:
            seqs.append((s, off, c, start))
        if c < n:
            latent.append((off + c, off + n))
    if not seqs:
        return None
    latent = [(lo, hi) for lo, hi in latent if hi > lo]
    contiguous = len(latent) <= 1 and (not latent or latent[0][0] == 0)
    latent_rows: int | torch.Tensor = (latent[0][1] if latent else 0) if contiguous else \
        to_device(torch.cat([torch.arange(lo, hi) for lo, hi in latent]), dev)
    groups, group, keys = [], [], 0
    for seq in seqs:
        n_keys = seq[3] + seq[2]
        if group and keys + n_keys > max_keys:
            groups.append(_group(group, tables, block_size, bm))
            group, keys = [], 0
        group.append(seq)
        keys += n_keys
    groups.append(_group(group, tables, block_size, bm))
    return ExpandedRows(groups, latent_rows)


def _group(seqs: list[tuple[int, int, int, int]], tables: torch.Tensor, block_size: int, bm: int) -> ExpandedGroup:
    tiles, key0 = [], 0
    for _, off, c, start in seqs:
        tiles += [(off + i, min(bm, c - i), start + i, key0) for i in range(0, c, bm)]
        key0 += start + c
    tiles.sort(key=lambda tile: -(tile[2] + tile[1]))
    n_keys = [start + c for _, _, c, start in seqs]
    key_seq = torch.repeat_interleave(torch.tensor([s for s, *_ in seqs]), torch.tensor(n_keys), output_size=key0)
    key_pos = torch.cat([torch.arange(n) for n in n_keys])
    dev = tables.device
    host = torch.cat([torch.tensor(tiles, dtype=torch.int64).view(-1), key_seq, key_pos])
    tiles_d, seq_d, pos_d = torch.split(to_device(host, dev), [4 * len(tiles), key0, key0])
    key_rows = tables[seq_d, pos_d // block_size].long() * block_size + pos_d % block_size
    return ExpandedGroup(tiles_d.to(torch.int32).view(-1, 4), key_rows)
