"""The logical KV pool: which physical cache blocks and KDA state slots each sequence owns.

The ranks own the memory (docs/design.md §2); this class only decides addresses. A request reserves every block it can
ever need (prompt + max_tokens) plus one KDA slot when it is admitted to running, so a running request never runs
out of cache and nothing is ever preempted: the waiting queue absorbs the shortage instead.

Blocks carry reference counts so a prefix index can later share full prompt blocks between sequences (a shared
block is returned to the free list only when its last owner lets go). Freed blocks go to the back of the free
list and are handed out from the front, i.e. least recently freed first — the order an LRU prefix cache wants.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class PoolExhausted(RuntimeError):
    """A reservation was asked for that the pool cannot hold right now (callers check `can_reserve` first)."""


@dataclass
class Reservation:
    """What one sequence owns: its block table (in position order) and its KDA state slot."""

    blocks: list[int]
    slot: int
    released: bool = field(default=False, repr=False)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        if num_blocks < 1 or block_size < 1 or num_slots < 1:
            raise ValueError(f"a pool needs blocks, a block size and slots (got {num_blocks}, {block_size}, {num_slots})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_slots
        self._refs = [0] * num_blocks
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._free_slots: deque[int] = deque(range(num_slots))

    # -- sizing ---------------------------------------------------------------------------------------------------
    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold positions 0 .. n_tokens-1."""
        return -(-n_tokens // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def can_reserve(self, n_tokens: int) -> bool:
        return bool(self._free_slots) and self.blocks_for(n_tokens) <= len(self._free_blocks)

    def fits_ever(self, n_tokens: int) -> bool:
        """Whether a request of this size could be admitted into an otherwise empty pool."""
        return self.blocks_for(n_tokens) <= self.num_blocks

    # -- ownership ------------------------------------------------------------------------------------------------
    def reserve(self, n_tokens: int, shared: list[int] | None = None) -> Reservation:
        """Blocks for `n_tokens` positions plus one slot, all or nothing. `shared`: the first blocks of the table,
        already referenced for this sequence (a cached prefix, see `share`); only the rest come from the free list."""
        shared = shared or []
        need = self.blocks_for(n_tokens) - len(shared)
        if not self._free_slots or need > len(self._free_blocks):
            raise PoolExhausted(f"need {need} blocks and a slot; {len(self._free_blocks)} blocks, "
                                f"{len(self._free_slots)} slots free")
        blocks = [self._free_blocks.popleft() for _ in range(need)]
        for b in blocks:
            self._refs[b] = 1
        return Reservation(blocks=list(shared) + blocks, slot=self._free_slots.popleft())

    def take(self, n: int) -> list[int]:
        """`n` free blocks, one reference each, for the prefix index itself (a snapshot loaded from a KV tier)."""
        if n > len(self._free_blocks):
            raise PoolExhausted(f"need {n} blocks; {len(self._free_blocks)} free")
        blocks = [self._free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, block: int) -> int:
        """Take another reference on a block that is already owned (prefix sharing); returns the block."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is free; only owned blocks can be shared")
        self._refs[block] += 1
        return block

    def drop(self, block: int) -> None:
        """Drop one reference taken with `share` (the prefix index evicting a cached block)."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free_blocks.append(block)
        elif self._refs[block] < 0:
            raise AssertionError(f"block {block} dropped more often than it was taken")

    def release(self, res: Reservation) -> None:
        """Drop the sequence's references and its slot; idempotent, so abort and finish may race safely."""
        if res.released:
            return
        res.released = True
        for b in res.blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free_blocks.append(b)
            elif self._refs[b] < 0:  # a bookkeeping bug: say so loudly rather than hand a block out twice
                raise AssertionError(f"block {b} released more often than it was taken")
        self._free_slots.append(res.slot)

    def refcount(self, block: int) -> int:
        return self._refs[block]
