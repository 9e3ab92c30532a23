"""PrefixIndex bookkeeping on its own: ref counts, supersession, eviction order, what eviction frees."""

from __future__ import annotations

from services.scheduler.pool import BlockPool
from services.scheduler.prefix import PrefixIndex, block_hashes, reuse_granule


def _index(blocks: int = 64, snaps: int = 3) -> PrefixIndex:
    pool = BlockPool(blocks, 16, 4)
    return PrefixIndex(pool, list(range(4, 4 + snaps)), granule=reuse_granule(16))


def _take(ix: PrefixIndex, tokens: list[int], pos: int, shared: bool = False):
    """A request prefills `tokens` and snapshots at `pos`; returns (its reservation, the snapshot)."""
    res = ix.pool.reserve(len(tokens) + 1)
    snap = ix.take(block_hashes(tokens, 16, pos), res.blocks, shared=shared)
    ix.sent(snap)
    return res, snap


def test_granule_and_hash_chain():
    assert reuse_granule(16) == 64 and reuse_granule(128) == 128 and reuse_granule(48) == 192
    a, b = block_hashes(list(range(64)), 16, 64), block_hashes(list(range(63)) + [0], 16, 64)
    assert a[:3] == b[:3] and a[3] != b[3] and len(a) == 4
    assert block_hashes([9] * 16 + list(range(48)), 16, 64)[1] != a[1]  # a block's key depends on its past


def test_finished_request_frees_to_the_index_and_resume_shares_blocks():
    ix = _index()
    prompt = list(range(100))
    res, snap = _take(ix, prompt, 64)
    ix.pool.release(res)
    assert ix.pool.free_blocks == 64 - 4 and ix.idle_blocks == 4  # 4 cached blocks stay in the index
    m = ix.match(block_hashes(prompt, 16, 99), 100)
    assert (m.snapshot, m.pos, m.matched) == (snap, 64, 64)  # blocks stay cached while a snapshot covers them
    shared = ix.acquire(snap)
    assert shared == res.blocks[:4] and all(ix.pool.refcount(b) == 2 for b in shared)
    assert not snap.evictable and ix.reclaimable() == 0
    ix.copied_out(snap)
    assert snap.evictable
    # A prompt ending right at 64 cannot resume there (its last token must be computed): nothing usable.
    assert ix.match(block_hashes(prompt, 16, 63), 64).snapshot is None


def test_superseded_states_go_first_and_fork_states_never_are():
    ix = _index(snaps=3)
    turn1 = list(range(70))
    _, s1 = _take(ix, turn1, 64)
    _, other = _take(ix, list(range(500, 600)), 64)
    ix.acquire(s1), ix.copied_out(s1)  # turn 2 resumes from turn 1: s1 is now the most recently used
    _, s2 = _take(ix, turn1 + list(range(70, 140)), 128)
    assert s1.superseded and not other.superseded
    _, s3 = _take(ix, list(range(900, 1000)), 64)  # needs a slot: the superseded s1 goes, not the LRU `other`
    assert s1.key not in ix.snaps and other.key in ix.snaps and s2.key in ix.snaps
    fork = _index()
    _, f = _take(fork, turn1, 64, shared=True)
    _take(fork, turn1 + list(range(70, 140)), 128)
    assert not f.superseded


def test_make_room_skips_snapshots_that_free_nothing_and_clear_forgets_all():
    ix = _index(blocks=16, snaps=3)
    prompt = list(range(140))
    res, deep = _take(ix, prompt, 128)  # 8 blocks
    shallow = ix.take(block_hashes(prompt, 16, 64), res.blocks, shared=True)  # its first 4
    ix.sent(shallow)
    ix.pool.release(res)
    assert ix.pool.free_blocks == 8 and ix.reclaimable() == 8
    shallow.last_used, deep.last_used = 0, 10**9  # the shallow one is LRU, but evicting it alone frees nothing
    ix.make_room(12)
    assert deep.key not in ix.snaps and shallow.key in ix.snaps and ix.pool.free_blocks == 12
    assert ix.cached_blocks == 4
    ix.clear()
    assert not ix.snaps and not ix.blocks and ix.pool.free_blocks == 16
