"""KV tiers behind the pool, as the scheduler sees them: which evicted blocks and KDA snapshot states the ranks keep
in host RAM and on disk, and the moves that put them there and bring them back (StepPlan.tier_moves).

The ranks store (services/rank_worker/kv_tiers.py); this index decides, so every rank holds the same keys:
- A pool snapshot the prefix index evicts becomes a **tier snapshot** (its state saved from its slot) and the blocks
  of its chain that leave the pool at the same time are saved too; blocks of its chain still in the pool are saved
  when they leave it later. A block is kept while some tier snapshot needs it (`need`).
- New entries go to host RAM (to disk when host RAM is off). Past the host capacity the least recently used host
  entries spill to disk (or are dropped without one); past the disk capacity the least recently used disk entries
  are dropped. Dropping a block drops every tier snapshot whose chain holds it, and their now unneeded blocks.
- A tier snapshot is usable when its state and every block of its chain are in the pool or a tier. Loading one
  (`load`) copies the missing blocks into free pool blocks and the state into a snapshot slot; the ranks verify each
  entry's checksum and report bad ones (StepResult.tier_bad): those are dropped here too (`bad`) and the request
  that wanted them recomputes.
- Capacities are per rank (each rank keeps its own shard of every entry, all of the same size).
- The disk tier outlives the processes: at start `restore` rebuilds the index from the entries every rank lists.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from services.common.tensors import to_proto
from twinspark.v1 import generate_pb2, rank_pb2

HOST, DISK = "host", "disk"


@dataclass
class Entry:
    key: bytes
    size: int
    where: str
    last_used: int


def state_key(snap_key: bytes) -> bytes:
    """The tier key of a snapshot's KDA state: a snapshot's key is its last block's key, so it gets a prefix."""
    return b"S" + snap_key


@dataclass
class TierSnap:
    key: bytes  # the snapshot's key (its last block's key)
    pos: int
    chain: list[bytes]

    @property
    def state(self) -> bytes:
        return state_key(self.key)


@dataclass
class TierFigures:
    hits: int = 0  # prompt tokens whose blocks came back from this tier
    evictions: int = 0
    corrupt: int = 0


@dataclass
class TierIndex:
    host_capacity: int
    disk_capacity: int
    block_bytes: int
    state_bytes: int
    block_size: int
    entries: dict[bytes, Entry] = field(default_factory=dict)
    snaps: dict[bytes, TierSnap] = field(default_factory=dict)
    need: Counter = field(default_factory=Counter)  # block key -> tier snapshots whose chain holds it
    moves: list[rank_pb2.TierMove] = field(default_factory=list)  # for the next plan, in order
    figures: dict[str, TierFigures] = field(default_factory=lambda: {HOST: TierFigures(), DISK: TierFigures()})

    def __post_init__(self) -> None:
        self._clock = itertools.count(1)
        self.used = {HOST: 0, DISK: 0}

    @property
    def on(self) -> bool:
        return self.host_capacity > 0 or self.disk_capacity > 0

    def _new_home(self) -> str:
        return HOST if self.host_capacity > 0 else DISK

    # -- entries --------------------------------------------------------------------------------------------------
    def _add(self, key: bytes, size: int, where: str) -> None:
        self.entries[key] = Entry(key, size, where, next(self._clock))
        self.used[where] += size

    def _forget(self, key: bytes) -> Entry | None:
        e = self.entries.pop(key, None)
        if e is not None:
            self.used[e.where] -= e.size
        return e

    def _drop(self, key: bytes, *, tell_ranks: bool = True) -> None:
        """Forget an entry (`tell_ranks`: and drop it on the ranks, unless they did already), then every tier
        snapshot that can no longer be whole without it and their blocks nobody needs any more."""
        e = self._forget(key)
        if e is not None and tell_ranks:
            self.moves.append(rank_pb2.TierMove(kind=rank_pb2.TIER_DROP, block_keys=[key]))
        for s in [s for s in self.snaps.values() if s.state == key or key in s.chain]:
            self._drop_snap(s)

    def _drop_snap(self, s: TierSnap) -> None:
        if self.snaps.pop(s.key, None) is None:
            return
        if s.state in self.entries:
            self._drop(s.state)
        for h in s.chain:
            self.need[h] -= 1
            if self.need[h] <= 0:
                del self.need[h]
                if h in self.entries:
                    self._drop(h)

    def _fit(self) -> None:
        """Spill / drop least recently used entries until both tiers are within their capacities."""
        for where, cap in ((HOST, self.host_capacity), (DISK, self.disk_capacity)):
            while self.used[where] > cap:
                victim = min((e for e in self.entries.values() if e.where == where), key=lambda e: e.last_used)
                self.figures[where].evictions += 1
                if where == HOST and self.disk_capacity > 0:
                    self.used[HOST] -= victim.size
                    self.used[DISK] += victim.size
                    victim.where = DISK
                    self.moves.append(rank_pb2.TierMove(kind=rank_pb2.TIER_SPILL, block_keys=[victim.key]))
                else:
                    self._drop(victim.key)

    # -- pool -> tier ---------------------------------------------------------------------------------------------
    def keep(self, key: bytes, pos: int, chain: list[bytes], slot: int, leaving: dict[bytes, int]) -> None:
        """A pool snapshot is evicted: keep it (state from `slot`) and save the blocks leaving the pool with it
        (`leaving`: block key -> pool block) that some tier snapshot needs."""
        where = self._new_home()
        move = rank_pb2.TierMove(kind=rank_pb2.TIER_SAVE, to_disk=where == DISK)
        if key not in self.snaps:
            self.snaps[key] = TierSnap(key, pos, list(chain))
            self.need.update(chain)
        sk = state_key(key)
        if sk not in self.entries:
            move.state_key, move.slot, move.pos, move.chain = sk, slot, pos, b"".join(chain)
            self._add(sk, self.state_bytes, where)
        else:
            self.entries[sk].last_used = next(self._clock)
        blocks = []
        for h, b in leaving.items():
            if self.need[h] > 0 and h not in self.entries:
                move.block_keys.append(h)
                blocks.append(b)
                self._add(h, self.block_bytes, where)
        if blocks:
            move.blocks.CopyFrom(to_proto(blocks))
        if move.block_keys or move.state_key:
            self.moves.append(move)
        self._fit()

    def persist(self, snaps: list[tuple[bytes, int, list[bytes], int, dict[bytes, int]]]) -> None:
        """Shutdown: every pool snapshot (key, pos, chain, slot, its blocks by key) and every host entry goes to
        disk, so a restart with the same checkpoint finds them (least recently used first out if disk is short)."""
        for e in self.entries.values():
            if e.where == HOST:
                self.used[HOST] -= e.size
                self.used[DISK] += e.size
                e.where = DISK
                self.moves.append(rank_pb2.TierMove(kind=rank_pb2.TIER_SPILL, block_keys=[e.key]))
        host, self.host_capacity = self.host_capacity, 0  # new entries go straight to disk
        try:
            for key, pos, chain, slot, blocks in snaps:
                self.keep(key, pos, chain, slot, blocks)
        finally:
            self.host_capacity = host

    # -- tier -> pool ---------------------------------------------------------------------------------------------
    def best(self, hashes: list[bytes], cap: int, granule: int, in_pool) -> TierSnap | None:
        """The deepest usable tier snapshot on `hashes`' chain at a position <= cap (a multiple of `granule`);
        `in_pool(h)` says whether block h is in the pool's prefix index."""
        bs = self.block_size
        pos = min(cap, len(hashes) * bs) // granule * granule
        while pos > 0:
            s = self.snaps.get(hashes[pos // bs - 1])
            if s is not None and s.state in self.entries and all(h in self.entries or in_pool(h) for h in s.chain):
                return s
            pos -= granule
        return None

    def load(self, s: TierSnap, targets: dict[bytes, int], slot: int) -> None:
        """Plan loading tier snapshot `s`: its state into `slot`, blocks `targets` (key -> free pool block)."""
        tick = next(self._clock)
        for h in targets:
            e = self.entries[h]
            e.last_used = tick
            self.figures[e.where].hits += self.block_size
        self.entries[s.state].last_used = tick
        for h in s.chain:  # blocks it shares with the pool stay hot too
            if h in self.entries:
                self.entries[h].last_used = tick
        self.moves.append(rank_pb2.TierMove(kind=rank_pb2.TIER_LOAD, block_keys=list(targets),
                                            blocks=to_proto(list(targets.values())), state_key=s.state, slot=slot))

    def bad(self, keys: list[bytes]) -> None:
        """Entries that failed their checksum on some rank's load: every rank dropped them already."""
        for key in keys:
            e = self.entries.get(key)
            if e is not None:
                self.figures[e.where].corrupt += 1
            self._drop(key, tell_ranks=False)

    def take_moves(self) -> list[rank_pb2.TierMove]:
        moves, self.moves = self.moves, []
        return moves

    # -- restart --------------------------------------------------------------------------------------------------
    def restore(self, listing: list[rank_pb2.TierEntry]) -> None:
        """Rebuild from the disk entries every rank holds (oldest first); entries that cannot serve (a state whose
        blocks are missing, a block no state needs) are dropped on the ranks."""
        for e in sorted(listing, key=lambda e: e.mtime):
            self._add(e.key, self.state_bytes if e.state else self.block_bytes, DISK)
            if e.state and e.key[:1] == b"S" and len(e.chain) % 16 == 0 and e.chain:
                chain = [e.chain[i : i + 16] for i in range(0, len(e.chain), 16)]
                self.snaps[e.key[1:]] = TierSnap(e.key[1:], int(e.pos), chain)
                self.need.update(chain)
        for s in list(self.snaps.values()):
            if not all(h in self.entries for h in s.chain):
                self._drop_snap(s)
        states = {s.state for s in self.snaps.values()}
        for key in [k for k in self.entries if k not in states and self.need[k] <= 0]:
            self._drop(key)
        self._fit()

    # -- figures --------------------------------------------------------------------------------------------------
    def stats(self) -> list[generate_pb2.TierStats]:
        out = []
        for where, cap in ((HOST, self.host_capacity), (DISK, self.disk_capacity)):
            if cap <= 0:
                continue
            f = self.figures[where]
            out.append(generate_pb2.TierStats(
                tier=where, bytes=self.used[where], capacity=cap,
                entries=sum(1 for e in self.entries.values() if e.where == where),
                hits=f.hits, evictions=f.evictions, corrupt=f.corrupt))
        return out
