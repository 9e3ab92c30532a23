"""The one input shape of every forward: a packed batch of new rows from many sequences.

Prefill chunks, decode rows and verify windows are all the same thing here: sequence s contributes `lengths[s]`
consecutive new tokens starting at absolute position `starts[s]` (the number of its tokens already in the cache).
Its cached rows live in the physical blocks listed in `block_tables[s]`, its KDA state in slot `slots[s]`; a
sequence with start 0 begins from zero KDA/conv state whatever the slot held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.gpu import to_device


@dataclass
class Batch:
    token_ids: torch.Tensor  # [T] int64, rows of all sequences, sequence after sequence
    starts: list[int]  # per sequence: absolute position of its first new row
    lengths: list[int]  # per sequence: number of new rows
    block_tables: torch.Tensor  # [B, max_blocks] int64 physical block ids
    slots: list[int]  # per sequence: KDA state slot
    logit_rows: torch.Tensor  # [R] int64 packed-row indices whose logits are wanted
    hidden: torch.Tensor | None = None  # [T, D] the target's final hidden per row (MTP input only)
    # Per sequence: True = its rows are a verify window (row 0 the last committed token, rows 1.. drafts). Such a
    # sequence runs every row with one-row-decode arithmetic, the KDA layers keep each row's state, and nothing is
    # committed to its slot until `PagedCache`'s owner calls `commit_verify` with how many rows were accepted.
    verify: list[bool] | None = None
    # Per sequence: True = its rows are prompt tokens (a prefill chunk, prefill arithmetic); False = generated rows (a
    # decode step or a verify window). None: a sequence with several rows and no verify flag is a prompt chunk.
    # The GPU fast path needs the decode-class sequences first (`class_order` / `permuted`); the CPU path does not.
    prompt: list[bool] | None = None
    # (first packed row, [n, D] embeddings): rows whose input is an image's embeddings rather than their token's
    # (vision placeholders; the CPU path merges them after the embedding lookup)
    embeds: list[tuple[int, torch.Tensor]] | None = None
    _positions: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.lengths) or len(self.slots) != len(self.lengths):
            raise ValueError("starts, lengths and slots must have one entry per sequence")
        if sum(self.lengths) != self.token_ids.numel():
            raise ValueError(f"lengths sum to {sum(self.lengths)} but there are {self.token_ids.numel()} rows")
        if any(n < 1 for n in self.lengths) or any(s < 0 for s in self.starts):
            raise ValueError("every sequence needs at least one new row and a non-negative start")
        if self.verify is not None and len(self.verify) != len(self.lengths):
            raise ValueError("verify must have one entry per sequence")
        if self.prompt is not None and len(self.prompt) != len(self.lengths):
            raise ValueError("prompt must have one entry per sequence")
        if any(self.is_verify(s) and self.is_prompt(s) for s in range(self.num_seqs)):
            raise ValueError("a verify window cannot be a prompt chunk")

    def is_verify(self, s: int) -> bool:
        return bool(self.verify[s]) if self.verify is not None else False

    @property
    def has_verify(self) -> bool:
        return self.verify is not None and any(self.verify)

    def is_prompt(self, s: int) -> bool:
        if self.prompt is not None:
            return bool(self.prompt[s])
        return self.lengths[s] > 1 and not self.is_verify(s)

    def class_order(self) -> list[int]:
        """Sequence order with the decode-class ones (decode steps, verify windows) first, each group stable."""
        seqs = range(self.num_seqs)
        return [s for s in seqs if not self.is_prompt(s)] + [s for s in seqs if self.is_prompt(s)]

    @property
    def decode_rows(self) -> int:
        """Rows of the decode-class sequences, which must come first (`class_order`)."""
        n = sum(length for s, length in enumerate(self.lengths) if not self.is_prompt(s))
        if self.class_order() != list(range(self.num_seqs)):
            raise ValueError("decode-class sequences must come before prompt chunks (Batch.permuted)")
        return n

    def permuted(self, order: list[int]) -> tuple["Batch", torch.Tensor]:
        """The same batch with its sequences in `order`, and old packed row -> new packed row ([T] int64)."""
        offsets = self.offsets
        rows = torch.cat([torch.arange(offsets[s], offsets[s] + self.lengths[s]) for s in order])
        row_map = torch.empty_like(rows)
        row_map[rows] = torch.arange(rows.numel())
        dev = self.token_ids.device
        pick = lambda xs: None if xs is None else [xs[s] for s in order]  # noqa: E731
        batch = Batch(token_ids=self.token_ids[to_device(rows, dev)], starts=pick(self.starts),
                      lengths=pick(self.lengths),
                      block_tables=self.block_tables[to_device(torch.tensor(order), self.block_tables.device)],
                      slots=pick(self.slots), logit_rows=row_map.to(self.logit_rows.device)[self.logit_rows],
                      hidden=None if self.hidden is None else self.hidden[to_device(rows, self.hidden.device)],
                      verify=pick(self.verify), prompt=[self.is_prompt(s) for s in order],
                      # a sequence's rows stay contiguous, so an image's run of rows moves as one
                      embeds=None if self.embeds is None else [(int(row_map[r]), e) for r, e in self.embeds])
        return batch, row_map

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def offsets(self) -> list[int]:
        """Packed-row index of each sequence's first row (cu_seqlens without the final entry)."""
        out, acc = [], 0
        for n in self.lengths:
            out.append(acc)
            acc += n
        return out

    @property
    def positions(self) -> torch.Tensor:
        """Absolute position of every packed row."""
        if self._positions is None:
            self._positions = to_device(self.host_positions(), self.token_ids.device)
        return self._positions

    def host_positions(self) -> torch.Tensor:
        """`positions` on the host (int64), built from the lists without reading the device."""
        return torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths)])

    @property
    def row_seq(self) -> torch.Tensor:
        """Sequence index of every packed row."""
        return self.host_row_seq().to(self.token_ids.device)

    def host_row_seq(self) -> torch.Tensor:
        """`row_seq` on the host (int64), from the lists (the size given, so it never reads a device)."""
        return torch.repeat_interleave(torch.arange(self.num_seqs), torch.tensor(self.lengths),
                                       output_size=self.token_ids.numel())

    @classmethod
    def single(cls, token_ids: list[int], start: int, block_table: list[int], slot: int = 0,
               all_logits: bool = False, device: torch.device | str = "cpu") -> "Batch":
        """One sequence's chunk (a convenience for offline use and tests)."""
        n = len(token_ids)
        rows = torch.arange(n) if all_logits else torch.tensor([n - 1])
        return cls(token_ids=torch.tensor(token_ids, dtype=torch.long, device=device), starts=[start], lengths=[n],
                   block_tables=torch.tensor([block_table], dtype=torch.long, device=device), slots=[slot],
                   logit_rows=rows)  # host indices: the GPU path splits them by row class without a sync
