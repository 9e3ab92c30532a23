"""The scheduler's side of the ranks' KV cache: the block pool, the prefix index and its KV tiers, together.

A request reserves all it can ever need at admission (pool.py), minus the blocks of the deepest cached prefix it
resumes from; this object decides those reservations, the KDA state copies each plan carries (resumes, and snapshots
of the states where a prefill chunk ended), and what a round's KV tier loads left usable. It is rebuilt empty when
the rank group restarts (the ranks' caches are empty then), keeping the exported figures.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.scheduler.batcher import PlannedSeq
from services.scheduler.kv_events import KVEvents
from services.scheduler.kv_tiers import TierIndex, state_key
from services.scheduler.model_info import ModelInfo
from services.scheduler.pool import BlockPool, PoolExhausted, Reservation
from services.scheduler.prefix import Match, PrefixIndex, Snapshot, block_hashes, reuse_granule
from services.scheduler.request import Request
from twinspark.v1 import generate_pb2, rank_pb2

if TYPE_CHECKING:
    from services.scheduler.engine import EngineConfig

log = logging.getLogger("twinspark.scheduler")


def snapshot_slots(cfg: EngineConfig, info: ModelInfo) -> int:
    """KDA slots kept for the prefix index's snapshots (the rest hold running requests' states)."""
    if not cfg.enable_prefix_caching:
        return 0
    snaps = cfg.max_snapshots if cfg.max_snapshots is not None else max(0, min(16, info.num_slots - cfg.max_num_seqs))
    if not 0 <= snaps < info.num_slots:
        raise ValueError(f"--max-snapshots must be in [0, {info.num_slots}) (the ranks have {info.num_slots} "
                         f"KDA slots and running requests need at least one), got {snaps}")
    if not snaps:
        log.warning("prefix caching is on but no KDA slot is left for snapshots (%d slots, max_num_seqs %d): "
                    "raise the ranks' --num-slots or set --max-snapshots", info.num_slots, cfg.max_num_seqs)
    return snaps


class KVCacheManager:
    def __init__(self, info: ModelInfo, snapshots: int, tier_listing: list[rank_pb2.TierEntry],
                 old: KVCacheManager | None = None, events: KVEvents | None = None) -> None:
        """`snapshots` slots of the ranks' KDA slots go to the prefix index (none: no prefix caching);
        `tier_listing`: the disk tier entries every rank holds; `old`: the manager this one replaces, whose figures
        carry over so the exported counters never go backwards; `events`: where the index publishes its blocks."""
        self.snapshots = snapshots
        # Slots [0, n) hold running requests' KDA states, [n, num_slots) the prefix index's snapshots.
        req_slots = info.num_slots - snapshots
        self.pool = BlockPool(info.num_blocks, info.block_size, req_slots)
        tiers = None
        if snapshots and (info.tier_host_bytes > 0 or info.tier_disk_bytes > 0):
            # The host tier is gone with the old ranks; the disk tier is what every new rank lists.
            tiers = TierIndex(host_capacity=info.tier_host_bytes, disk_capacity=info.tier_disk_bytes,
                              block_bytes=info.block_bytes, state_bytes=info.state_bytes,
                              block_size=info.block_size)
            tiers.restore(tier_listing)
            if old is not None and old.prefix is not None and old.prefix.tiers is not None:
                tiers.figures = old.prefix.tiers.figures
            log.info("kv tiers: host %d bytes, disk %d bytes per rank; %d snapshots on disk", tiers.host_capacity,
                     tiers.disk_capacity, len(tiers.snaps))
        self.prefix = PrefixIndex(self.pool, list(range(req_slots, info.num_slots)),
                                  granule=reuse_granule(info.block_size), tiers=tiers,
                                  events=events) if snapshots else None
        if old is not None and old.prefix is not None and self.prefix is not None:
            self.prefix.queries, self.prefix.hits = old.prefix.queries, old.prefix.hits
        # (request slot, snapshot) copies that go out in the next plan (the request may be done by then: its slot
        # is only reused by a later plan, whose copies run before its forward)
        self._takes_next: list[tuple[int, Snapshot]] = []

    # -- admission ------------------------------------------------------------------------------------------------
    def _match(self, req: Request) -> Match | None:
        if self.prefix is None:
            return None
        if req.block_hashes is None:  # full blocks of [0, prompt_len - 1): the last prompt token is always computed
            req.block_hashes = block_hashes(req.tokens, self.pool.block_size, req.prompt_len - 1, req.image_spans)
        m = self.prefix.match(req.block_hashes, req.prompt_len)
        if req.prompt_logprobs is not None:
            # Prompt logprobs come from the prefill's own rows: such a request computes its whole prompt, never
            # resuming from a snapshot (the snapshots it takes on the way serve the next requests).
            return Match(None, 0, m.matched)
        return m

    def fits(self, req: Request) -> bool:
        """Whether `req` can be admitted now: a slot, and its blocks from the free list plus what evicting idle
        cached prefixes would free (a reused prefix's blocks are not needed again)."""
        if self.pool.free_slots < 1:
            return False
        m = self._match(req)
        if m is None:
            return self.pool.can_reserve(req.reserve_tokens)
        need = self.pool.blocks_for(req.reserve_tokens) - m.pos // self.pool.block_size
        if need <= self.pool.free_blocks:
            return True
        return need <= self.pool.free_blocks + self.prefix.reclaimable(keep=m.snapshot)

    def reserve(self, req: Request) -> None:
        """`req`'s blocks and slot, resuming from its deepest cached (or tiered) prefix; raises PoolExhausted and
        then takes nothing."""
        m = self._match(req)
        if m is None:
            req.reservation = self.pool.reserve(req.reserve_tokens)
            return
        prefix = self.prefix
        assert prefix is not None and req.block_hashes is not None
        ts = prefix.tier_match(req.block_hashes, req.prompt_len, m.pos) if req.prompt_logprobs is None else None
        if ts is not None:  # a deeper snapshot waits in a KV tier: load it (the request runs once it is back)
            snap = prefix.load(ts)
            if snap is not None:
                m = Match(snap, snap.pos, max(m.matched, snap.pos))
        shared: list[int] = []
        if m.snapshot is not None:
            shared = prefix.acquire(m.snapshot)
        need = self.pool.blocks_for(req.reserve_tokens) - len(shared)
        prefix.make_room(need)
        if need > self.pool.free_blocks:
            # `fits` counted cached blocks that eviction could not free after all (a request that needs nearly the
            # whole pool, say): give the snapshot back and let the request wait instead of failing it.
            for b in shared:
                self.pool.drop(b)
            if m.snapshot is not None:
                prefix.copied_out(m.snapshot)
            raise PoolExhausted(f"need {need} free blocks, {self.pool.free_blocks} after evicting what can be")
        if m.snapshot is not None:
            req.resume = m.snapshot
            req.num_cached = req.cached_tokens = m.pos
        req.reservation = self.pool.reserve(req.reserve_tokens, shared)
        prefix.queries += req.prompt_len
        prefix.hits += m.pos
        self._plan_snapshots(req, m)

    def _plan_snapshots(self, req: Request, m: Match) -> None:
        """Snapshots to take during this prefill: at the fork point (the prompt shares more of a cached prefix than
        any snapshot covers: the next request with this prefix resumes there) and at the prompt end (the largest
        reuse point below it: a resend or a longer next turn of this conversation resumes there)."""
        assert self.prefix is not None
        g = self.prefix.granule
        fork = min(m.matched, req.prompt_len - 1) // g * g
        end = (req.prompt_len - 1) // g * g
        if fork > m.pos:
            req.snap_points.append((fork, True))
        if end > max(m.pos, fork):
            req.snap_points.append((end, False))

    def unreserve(self, req: Request) -> None:
        """Undo the reservation of an admitted request that never ran (its resume point is gone), figures too."""
        assert self.prefix is not None and req.reservation is not None and req.resume is not None
        self.pool.release(req.reservation)
        self.prefix.copied_out(req.resume)
        self.prefix.queries -= req.prompt_len
        self.prefix.hits -= req.cached_tokens
        req.reservation, req.resume = None, None
        req.num_cached = req.cached_tokens = 0
        req.snap_points = []

    def drop_resume(self, req: Request) -> None:
        """`req` will never copy the snapshot it was to resume from (admitted but never planned)."""
        if req.resume is not None and self.prefix is not None:
            self.prefix.copied_out(req.resume)
            req.resume = None

    def release(self, res: Reservation, holder: Request) -> None:
        """Free `res` now, or once `holder`'s rows in flight are back (they still write its blocks and slot)."""
        if holder.pending_rows:
            holder.reservation, holder.release_deferred = res, True
        else:
            self.pool.release(res)

    def release_deferred(self, req: Request) -> None:
        """`req`'s rows came back: free what it kept for them (`release`) once the last are in."""
        if req.release_deferred and req.pending_rows == 0 and req.reservation is not None:
            req.release_deferred = False
            self.pool.release(req.reservation)

    # -- plans ----------------------------------------------------------------------------------------------------
    def state_copies(self, seqs: list[PlannedSeq]) -> list[tuple[int, int]]:
        """This plan's KDA state copies, in order: snapshots taken when the previous plan's chunks ended at a
        snapshot point (request slot -> snapshot slot; the slot still holds the state at that position), then
        resumes of requests whose first chunk is in this plan (snapshot slot -> request slot). Also registers the
        snapshots this plan's chunks reach, to be copied in the next plan."""
        if self.prefix is None:
            return []
        copies: list[tuple[int, int]] = []
        for slot, snap in self._takes_next:
            copies.append((slot, snap.slot))
            self.prefix.sent(snap)
        self._takes_next = []
        for s in seqs:
            req, res = s.req, s.req.reservation
            assert res is not None
            if req.resume is not None:
                copies.append((req.resume.slot, res.slot))
                self.prefix.copied_out(req.resume)
                req.resume = None
            end = s.start + len(s.token_ids)
            while req.snap_points and req.snap_points[0][0] <= end:
                pos, shared = req.snap_points.pop(0)
                if pos != end:
                    continue  # not reached exactly (cannot happen: chunks end at snapshot points)
                assert req.block_hashes is not None
                snap = self.prefix.take(req.block_hashes[: pos // self.pool.block_size], res.blocks, shared=shared,
                                        tokens=req.tokens)
                if snap is not None:
                    self._takes_next.append((res.slot, snap))
        return copies

    @property
    def tier_work(self) -> bool:
        """KV tier moves wait for a plan (a load a request waits for, saves of what admission evicted)."""
        return self.prefix is not None and self.prefix.tiers is not None and bool(self.prefix.tiers.moves)

    def take_tier_moves(self) -> tuple[list[rank_pb2.TierMove], list[Snapshot]]:
        """The moves for the next plan and the snapshots it loads (usable once that round is back)."""
        if self.prefix is None or self.prefix.tiers is None:
            return [], []
        return self.prefix.tiers.take_moves(), self.prefix.take_loads()

    def loads_back(self, loads: list[Snapshot], bad: list[bytes], restart: Callable[[Snapshot], None]) -> None:
        """A round with KV tier loads is back. A snapshot whose state or blocks failed a checksum on some rank is
        forgotten (every rank dropped the bad entries), and `restart` sends the requests that were to resume from
        it back to the queue, before the next snapshot is looked at."""
        prefix = self.prefix
        if prefix is None or prefix.tiers is None or not (loads or bad):
            return
        gone = set(bad)
        for snap in loads:
            ok = state_key(snap.key) not in gone and not gone.intersection(snap.chain)
            prefix.loaded(snap, ok)
            if not ok:
                log.warning("kv tier: snapshot at %d failed its checksum on load; dropped, recomputing", snap.pos)
                restart(snap)
        prefix.tiers.bad(bad)

    def persist_moves(self) -> list[rank_pb2.TierMove]:
        """With a disk KV tier: the moves that save every snapshot there (at shutdown, so a restart resumes them)."""
        prefix = self.prefix
        if prefix is None or prefix.tiers is None or prefix.tiers.disk_capacity <= 0:
            return []
        prefix.persist()
        return prefix.tiers.take_moves()

    def forget_snapshots(self) -> None:
        """Trust no snapshot: after a loop error, a state copy planned in the failed round may never have run."""
        if self.prefix is not None:
            self.prefix.clear()
            self._takes_next = []

    # -- figures --------------------------------------------------------------------------------------------------
    def pool_stats(self, replays: list[Request]) -> generate_pb2.PoolStats:
        """Cached blocks that no request reads count as free (they are evicted as soon as admission needs them),
        as in vLLM, and so do the blocks only reply replays hold, alone or with the prefix index (a replay gives way
        to any request that needs them, and may be held a while before it runs); slots are the running requests'
        slots (snapshot slots are the prefix index's)."""
        p = self.pool
        upkeep: Counter[int] = Counter()  # references the prefix index and the replays hold, per block
        if self.prefix is not None:
            upkeep.update(c.block for c in self.prefix.blocks.values())
        upkeep.update(b for r in replays if r.reservation is not None for b in r.reservation.blocks)
        idle = sum(1 for b, n in upkeep.items() if p.refcount(b) == n)
        return generate_pb2.PoolStats(block_size=p.block_size, total_blocks=p.num_blocks,
                                      free_blocks=p.free_blocks + idle, total_slots=p.num_slots,
                                      free_slots=p.free_slots)

    def tier_stats(self) -> list[generate_pb2.TierStats]:
        tiers = self.prefix.tiers if self.prefix is not None else None
        return tiers.stats() if tiers is not None else []

    @property
    def prefix_queries(self) -> int:
        return self.prefix.queries if self.prefix is not None else 0

    @property
    def prefix_hits(self) -> int:
        return self.prefix.hits if self.prefix is not None else 0
