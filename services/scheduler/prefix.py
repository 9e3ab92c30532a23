"""The prefix index: full prompt blocks keyed by a hash chain, plus the KDA-state snapshots that make them reusable.

GLM-5.3-Flash is hybrid. Its MLA layers keep one latent row per position (paged blocks, shareable as they are), but
its KDA layers keep one recurrent + conv state per sequence, valid only at the position it was taken. So an MLA
prefix of length p is reusable only together with a KDA state snapshot taken exactly at position p, and the unit of
reuse here is the **snapshot**: (position p, the hash of the block chain [0, p), a snapshot slot on the ranks).
Every snapshot holds the cached blocks of its chain; a block stays in the index while some snapshot covers it.

- Keys: block i of a token sequence hashes (hash of block i-1, the block's token ids) — equal keys mean equal
  prefixes, so one lookup walks the chain from position 0.
- Reuse points are multiples of 64 positions (KDA's chunk size, rounded up to whole blocks): the chunked KDA kernel
  chunks relative to each call's start, so a call that starts at a multiple of 64 reproduces a fresh prefill's
  chunk grid, and a resumed request computes the same bits as a fresh one (below: what is bit-identical).
- Ref counts: the index holds one pool reference on each cached block; a request reading it holds another (so a
  cached block goes back to the free list only when it is evicted *and* no request reads it). A finishing request
  frees its cached blocks to the index, not to the free list.
- Snapshot slots are a budget (`--max-snapshots`) reserved from the ranks' KDA slot count. Each costs a full KDA
  state: at full size (GLM-5.3-Flash: 34 KDA layers x 64 heads x 128 x 128 fp32, + conv history) ~142 MB per
  snapshot on every rank, so the budget is small and eviction matters.
- Eviction (only when free blocks fall short at admission, or snapshot slots when a new snapshot is wanted):
  superseded conversation states first (a prompt-end snapshot on the path of a later, longer one: the conversation
  moved on), then least recently used. Shared-prefix (fork) snapshots are never marked superseded.

Exactness of a resumed reply (tested in tests/rank_worker/test_state_copies.py, tests/e2e/test_prefix_cache.py):
- Bit-identical: the KDA states, MLA latent rows and logits of a request resumed at p (a multiple of 64) equal those
  of a fresh prefill whose chunk boundaries are multiples of 64 — the scheduler cuts prefill chunks there whenever a
  chunk crosses one (batcher.plan_round) — because the chunked KDA kernel chunks relative to each call's start and
  every other op is row-invariant with absolute positions (docs/design.md §5.2). Same bits -> same sampled tokens, greedy
  or keyed-seeded.
- Not guaranteed bit-identical, token-identical in practice: a fresh prefill that had to cut a chunk off the 64 grid
  (less than 64 tokens of round budget left after decode rows) runs the same maths on a different chunk grid, so its
  fp32 rounding — and the last bits of its logits — may differ from the resumed run's. Likewise a fork snapshot
  taken by a request that recomputed already cached blocks is paired with the index's (first) copy of those blocks:
  same bits when both prefills ran on the 64 grid, else the same caveat.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.kv_tiers import TierIndex, TierSnap
from services.scheduler.pool import BlockPool

KDA_CHUNK = 64  # the chunked KDA kernel's chunk length (kernels/kda.py `chunked`)


def reuse_granule(block_size: int) -> int:
    """Reuse points are multiples of this: whole KDA chunks and whole blocks."""
    return KDA_CHUNK * block_size // math.gcd(KDA_CHUNK, block_size)


def block_hashes(tokens: list[int], block_size: int, upto: int,
                 images: list[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """Hash chain of the full blocks inside tokens[:upto]: h_i = sha256(h_{i-1} || block i's ids as int32 LE ||
    the content digest of every image whose placeholder tokens fall in block i). `images`: (offset, tokens,
    digest) — every image's placeholders are the same id, so without its digest two images would share a cache."""
    out: list[bytes] = []
    h = b""
    for i in range(upto // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        d = hashlib.sha256(h)
        d.update(struct.pack(f"<{block_size}i", *tokens[lo:hi]))
        for off, n, digest in images:
            if off < hi and off + n > lo:
                d.update(digest)
        h = d.digest()[:16]
        out.append(h)
    return out


@dataclass
class _Cached:
    block: int
    covers: int = 0  # snapshots whose chain includes this block


@dataclass(eq=False)
class Snapshot:
    slot: int
    pos: int
    chain: list[bytes]  # block hashes of [0, pos); chain[-1] is the key
    shared: bool  # a fork point (shared prefix) rather than one conversation's prompt end
    last_used: int = 0
    taken: bool = False  # its (request slot -> snapshot slot) copy went out in a plan
    readers: int = 0  # admitted requests whose (snapshot -> request slot) copy has not gone out yet
    superseded: bool = False
    loading: bool = False  # coming back from a KV tier: usable once the round that loads it is back, checksums good

    @property
    def key(self) -> bytes:
        return self.chain[-1]

    @property
    def evictable(self) -> bool:
        return self.taken and self.readers == 0


@dataclass
class Match:
    snapshot: Snapshot | None  # the deepest usable snapshot, or None
    pos: int  # its position (0 without one)
    matched: int  # prompt tokens whose blocks the index holds (consecutive from 0)


@dataclass
class PrefixIndex:
    pool: BlockPool
    slots: list[int]  # the ranks' KDA slots reserved for snapshots
    granule: int = KDA_CHUNK
    blocks: dict[bytes, _Cached] = field(default_factory=dict)
    snaps: dict[bytes, Snapshot] = field(default_factory=dict)
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found
    evictions: int = 0
    tiers: TierIndex | None = None  # where evicted snapshots and their blocks go (None: they are forgotten)
    events: Any = None  # kv_events.KVEvents: blocks joining and leaving the index are published (None: not)

    def __post_init__(self) -> None:
        self._free_slots: deque[int] = deque(self.slots)
        self._clock = 0
        self.loads: list[Snapshot] = []  # snapshots whose tier load goes out in the next plan

    # -- figures --------------------------------------------------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        return len(self.blocks)

    @property
    def idle_blocks(self) -> int:
        """Cached blocks no request reads (the index's own reference is the only one): free for accounting."""
        return sum(1 for c in self.blocks.values() if self.pool.refcount(c.block) == 1)

    def describe(self) -> str:
        return (f"prefix cache: {len(self.blocks)} blocks ({self.idle_blocks} idle), {len(self.snaps)}/"
                f"{len(self.slots)} snapshots, {self.evictions} evicted")

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- lookup ---------------------------------------------------------------------------------------------------
    def match(self, hashes: list[bytes], prompt_len: int) -> Match:
        """The deepest snapshot usable for a prompt (at most prompt_len - 1: its last token must still be computed
        to get logits), and how far its blocks match the index. `hashes` covers the full blocks of [0, prompt_len-1)."""
        matched = 0
        while matched < len(hashes) and hashes[matched] in self.blocks:
            matched += 1
        bs = self.pool.block_size
        pos = (min(matched * bs, prompt_len - 1) // self.granule) * self.granule
        while pos > 0:
            snap = self.snaps.get(hashes[pos // bs - 1])
            if snap is not None:
                return Match(snap, pos, matched * bs)
            pos -= self.granule
        return Match(None, 0, matched * bs)

    def acquire(self, snap: Snapshot) -> list[int]:
        """A request resumes from `snap`: a reference on each of its blocks (in position order) and one pending
        reader until the (snapshot -> request slot) copy goes out."""
        snap.readers += 1
        snap.last_used = self._tick()
        return [self.pool.share(self.blocks[h].block) for h in snap.chain]

    def pin(self, snap: Snapshot) -> None:
        """A reader that resumes from `snap` with blocks of its own (a reply replay): not evicted until the
        (snapshot -> request slot) copy goes out (`copied_out`)."""
        snap.readers += 1
        snap.last_used = self._tick()

    def copied_out(self, snap: Snapshot) -> None:
        snap.readers -= 1

    # -- snapshots ------------------------------------------------------------------------------------------------
    def take(self, chain: list[bytes], request_blocks: list[int], *, shared: bool,
             tokens: list[int] | None = None) -> Snapshot | None:
        """Register a snapshot at position len(chain) * block_size of a request whose blocks are `request_blocks`
        (the caller sends the (request slot -> snapshot slot) copy in the next plan and then calls `sent`). None
        when one exists there already (it is refreshed) or no snapshot slot can be had. `tokens`: the request's
        ids, for the block events (`events`)."""
        key = chain[-1]
        old = self.snaps.get(key)
        if old is not None:
            old.last_used = self._tick()
            if shared and not old.shared:  # a conversation's state turned out to be a shared prefix
                old.shared, old.superseded = True, False
            return None
        for h in chain[:-1]:  # conversation states on this path are superseded by the longer one (evicted first)
            s = self.snaps.get(h)
            if s is not None and not s.shared:
                s.superseded = True
        if not self._free_slots:
            victim = self._victim()
            if victim is None:
                return None
            self._evict(victim)
        snap = Snapshot(slot=self._free_slots.popleft(), pos=len(chain) * self.pool.block_size, chain=list(chain),
                        shared=shared, last_used=self._tick())
        joined: list[int] = []
        for i, (h, b) in enumerate(zip(chain, request_blocks)):
            c = self.blocks.get(h)
            if c is None:  # the request's own block joins the index (an equal block already cached is kept)
                c = self.blocks[h] = _Cached(self.pool.share(b))
                joined.append(i)
            c.covers += 1
        self.snaps[key] = snap
        if self.events is not None and tokens is not None:
            self._publish_stored(chain, joined, tokens)
        return snap

    def _publish_stored(self, chain: list[bytes], joined: list[int], tokens: list[int]) -> None:
        """One BlockStored per run of consecutive blocks of `chain` that joined the index (each run's parent is
        the block before it, already cached)."""
        bs = self.pool.block_size
        start = 0
        while start < len(joined):
            end = start
            while end + 1 < len(joined) and joined[end + 1] == joined[end] + 1:
                end += 1
            lo, hi = joined[start], joined[end] + 1
            self.events.stored(chain[lo:hi], chain[lo - 1] if lo else None, tokens[lo * bs:hi * bs])
            start = end + 1

    def sent(self, snap: Snapshot) -> None:
        snap.taken = True

    # -- eviction -------------------------------------------------------------------------------------------------
    def _order(self) -> list[Snapshot]:
        return sorted((s for s in self.snaps.values() if s.evictable), key=lambda s: (not s.superseded, s.last_used))

    def _victim(self) -> Snapshot | None:
        order = self._order()
        return order[0] if order else None

    def _evict(self, snap: Snapshot, save: bool = True) -> None:
        """Forget a snapshot and the blocks only it covered; with KV tiers (and `save`) they move there first."""
        del self.snaps[snap.key]
        self._free_slots.append(snap.slot)
        self.evictions += 1
        leaving: dict[bytes, int] = {}
        for h in snap.chain:
            c = self.blocks[h]
            c.covers -= 1
            if c.covers == 0:
                del self.blocks[h]
                self.pool.drop(c.block)
                leaving[h] = c.block
        if self.events is not None:
            self.events.removed(list(leaving))
        if save and self.tiers is not None and self.tiers.on and snap.taken and not snap.loading:
            # The save goes out in the next plan, before anything can reuse the slot or the blocks.
            self.tiers.keep(snap.key, snap.pos, snap.chain, snap.slot, leaving)

    def reclaimable(self, keep: Snapshot | None = None) -> int:
        """Blocks that evicting every evictable snapshot (but `keep`) would return to the free list."""
        pinned: set[bytes] = set()
        for s in self.snaps.values():
            if s is keep or not s.evictable:
                pinned.update(s.chain)
        return sum(1 for h, c in self.blocks.items() if h not in pinned and self.pool.refcount(c.block) == 1)

    def _frees(self, snap: Snapshot) -> bool:
        """Whether evicting `snap` returns a block to the free list (not when other snapshots or requests hold
        every block of its chain: then it is kept, it costs no blocks)."""
        return any(self.blocks[h].covers == 1 and self.pool.refcount(self.blocks[h].block) == 1 for h in snap.chain)

    def make_room(self, need_blocks: int, keep: frozenset[bytes] = frozenset()) -> None:
        """Evict (superseded first, then least recently used) until the free list holds `need_blocks`; never a
        snapshot whose eviction would drop a block of `keep` from the pool."""
        for snap in self._order():
            if self.pool.free_blocks >= need_blocks:
                return
            if self._frees(snap) and not self._drops(snap, keep):
                self._evict(snap)

    def _drops(self, snap: Snapshot, keep: frozenset[bytes]) -> bool:
        """Whether evicting `snap` would drop a block of `keep` from the index."""
        return any(self.blocks[h].covers == 1 and h in keep for h in snap.chain)

    def clear(self) -> None:
        """Forget every snapshot (after a loop error a planned state copy may never have run on the ranks, so
        none is saved to a tier either)."""
        for snap in list(self.snaps.values()):
            self._evict(snap, save=False)
        self.loads = []

    def persist(self) -> None:
        """Shutdown with a disk tier: every usable pool snapshot and its blocks are saved there (moves for one last
        plan)."""
        if self.tiers is None or self.tiers.disk_capacity <= 0:
            return
        self.tiers.persist([(s.key, s.pos, s.chain, s.slot, {h: self.blocks[h].block for h in s.chain})
                            for s in sorted(self.snaps.values(), key=lambda s: s.last_used)
                            if s.taken and not s.loading])

    # -- KV tiers -------------------------------------------------------------------------------------------------
    def tier_match(self, hashes: list[bytes], prompt_len: int, than: int) -> TierSnap | None:
        """A usable tier snapshot deeper than `than` for a prompt (see `match` for `hashes`), or None."""
        if self.tiers is None or not self.tiers.on:
            return None
        s = self.tiers.best(hashes, prompt_len - 1, self.granule, lambda h: h in self.blocks)
        return s if s is not None and s.pos > than else None

    def load(self, ts: TierSnap) -> Snapshot | None:
        """Bring tier snapshot `ts` back into the pool: a snapshot slot, free blocks for the part of its chain the
        pool lacks, and a load move in the next plan. The snapshot is `loading` until that round is back (`loaded`).
        None when no slot or not enough blocks can be had."""
        assert self.tiers is not None
        keep = frozenset(ts.chain)
        if not self._free_slots:
            victim = next((v for v in self._order() if not self._drops(v, keep)), None)
            if victim is None:
                return None
            self._evict(victim)
        missing = [h for h in ts.chain if h not in self.blocks]
        self.make_room(len(missing), keep=keep)
        if self.pool.free_blocks < len(missing):
            return None
        targets = dict(zip(missing, self.pool.take(len(missing))))
        for h in ts.chain:
            c = self.blocks.get(h)
            if c is None:
                c = self.blocks[h] = _Cached(targets[h])
            c.covers += 1
        snap = Snapshot(slot=self._free_slots.popleft(), pos=ts.pos, chain=list(ts.chain), shared=False,
                        last_used=self._tick(), loading=True)
        self.snaps[snap.key] = snap
        self.tiers.load(ts, targets, snap.slot)
        self.loads.append(snap)
        return snap

    def take_loads(self) -> list[Snapshot]:
        loads, self.loads = self.loads, []
        return loads

    def loaded(self, snap: Snapshot, ok: bool) -> None:
        """The round with `snap`'s load is back: usable, or (a checksum failed on some rank) forgotten."""
        snap.loading = False
        if ok:
            snap.taken = True
        elif self.snaps.get(snap.key) is snap:
            self._evict(snap, save=False)
