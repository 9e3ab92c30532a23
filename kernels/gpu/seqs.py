"""Row descriptions the GPU kernels take, kept free of Triton so the CPU path can build and pass them around."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeSeqs:
    """The decode-class sequences of one batch, as device int32 vectors (one entry per sequence)."""
    row0: torch.Tensor  # packed index of the sequence's first row
    length: torch.Tensor  # rows (1 for a decode step, the window size for a verify window)
    slot: torch.Tensor  # KDA state slot
    fresh: torch.Tensor  # 1 = starts at position 0 (zero state and history)
    pending: torch.Tensor  # a verify window's first row in the pending buffers, -1 = a decode step (into the slot)

    @classmethod
    def build(cls, row0: list[int], length: list[int], slot: list[int], fresh: list[bool], pending: list[int],
              device: torch.device | str) -> "DecodeSeqs":
        def vec(v: list) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32).to(device, non_blocking=True)
        return cls(vec(row0), vec(length), vec(slot), vec([int(f) for f in fresh]), vec(pending))

    @property
    def count(self) -> int:
        return self.row0.numel()
