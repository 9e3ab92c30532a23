"""The scheduler's KV tier index: what an evicted snapshot saves, LRU spill and drop with their cascade, which
snapshots are usable, bad entries, and rebuilding from a disk listing."""

from __future__ import annotations

from services.scheduler.kv_tiers import DISK, HOST, TierIndex, state_key
from twinspark.v1 import rank_pb2

BLOCK, STATE = 100, 1000


def keys(n: int, tag: bytes = b"a") -> list[bytes]:
    return [tag + bytes([i]) * 15 for i in range(n)]


def index(host: int, disk: int) -> TierIndex:
    return TierIndex(host_capacity=host, disk_capacity=disk, block_bytes=BLOCK, state_bytes=STATE, block_size=16)


def kinds(moves: list[rank_pb2.TierMove]) -> list[str]:
    return [rank_pb2.TierMoveKind.Name(m.kind) for m in moves]


def test_an_evicted_snapshot_saves_its_state_and_the_blocks_leaving_the_pool():
    t = index(10_000, 0)
    chain = keys(4)
    t.keep(chain[-1], 64, chain, slot=7, leaving={h: i for i, h in enumerate(chain[2:], start=2)})
    (move,) = t.take_moves()
    assert move.kind == rank_pb2.TIER_SAVE and not move.to_disk
    assert move.state_key == state_key(chain[-1]) and move.slot == 7 and move.pos == 64
    assert list(move.block_keys) == chain[2:] and move.chain == b"".join(chain)
    assert t.used[HOST] == STATE + 2 * BLOCK
    # Blocks 0-1 are still in the pool: usable while the pool has them, not once it has not.
    assert t.best(chain, 64, 64, lambda h: h in chain[:2]) is not None
    assert t.best(chain, 64, 64, lambda h: False) is None


def test_host_overflow_spills_lru_to_disk_then_disk_overflow_drops_whole_snapshots():
    t = index(host=STATE + 4 * BLOCK, disk=STATE + 4 * BLOCK)  # one snapshot with its blocks each
    chains = [keys(4, tag) for tag in (b"a", b"b", b"c")]
    for c in chains:
        t.keep(c[-1], 64, c, slot=1, leaving=dict(zip(c, range(4))))
    moves = kinds(t.take_moves())
    assert moves.count("TIER_SAVE") == 3 and "TIER_SPILL" in moves and "TIER_DROP" in moves
    # The oldest chain went host -> disk -> dropped, state and blocks alike; the newest is in host RAM.
    assert chains[0][-1] not in t.snaps and not any(h in t.entries for h in chains[0])
    assert all(t.entries[h].where == DISK for h in chains[1]) and t.entries[chains[2][0]].where == HOST
    assert t.used[HOST] <= t.host_capacity and t.used[DISK] <= t.disk_capacity
    assert t.figures[HOST].evictions >= 5 and t.figures[DISK].evictions >= 1


def test_a_bad_block_drops_every_snapshot_built_on_it():
    t = index(10_000, 0)
    short, long = keys(4), keys(8)  # the same conversation: long extends short
    t.keep(short[-1], 64, short, 1, dict(zip(short, range(4))))
    t.keep(long[-1], 128, long, 2, dict(zip(long[4:], range(4, 8))))
    t.take_moves()
    t.load(t.snaps[long[-1]], {h: i for i, h in enumerate(long)}, slot=3)
    assert kinds(t.take_moves()) == ["TIER_LOAD"] and t.figures[HOST].hits == 8 * 16
    t.bad([long[1]])  # block 1 failed its checksum on some rank: both snapshots hold it
    assert not t.snaps and not t.entries and t.figures[HOST].corrupt == 1 and t.used[HOST] == 0
    # The ranks dropped the bad entry themselves; what it leaves unusable is dropped on them too.
    assert set(kinds(t.take_moves())) == {"TIER_DROP"}


def test_restore_keeps_whole_snapshots_and_drops_orphans():
    t = index(0, 10_000)
    chain = keys(4)
    listing = [rank_pb2.TierEntry(key=h, mtime=1.0) for h in chain]
    listing.append(rank_pb2.TierEntry(key=state_key(chain[-1]), state=True, pos=64, chain=b"".join(chain), mtime=2.0))
    orphan = keys(1, b"z")[0]
    listing.append(rank_pb2.TierEntry(key=orphan, mtime=0.5))
    broken = keys(4, b"y")
    listing.append(rank_pb2.TierEntry(key=state_key(broken[-1]), state=True, pos=64, chain=b"".join(broken)))
    t.restore(listing)
    assert set(t.snaps) == {chain[-1]}
    assert t.best(chain, 64, 64, lambda h: False) is not None
    dropped = {k for m in t.take_moves() for k in [*m.block_keys, m.state_key] if k}
    assert dropped == {orphan, state_key(broken[-1])}
