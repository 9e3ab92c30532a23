"""The prefix index's block events (services/scheduler/kv_events.py): which changes are published, and the wire
format — three ZMQ frames, a msgpack batch `[ts, events, rank]` of maps tagged by "type" — read back by a real
ZMQ subscriber. (That vllm-router routes by them: tests/e2e/test_router.py.)"""

from __future__ import annotations

import time

import pytest

from services.rank_worker.distributed import free_port
from services.scheduler.kv_events import KVEvents
from services.scheduler.pool import BlockPool
from services.scheduler.prefix import PrefixIndex, block_hashes, reuse_granule

zmq = pytest.importorskip("zmq", reason="pyzmq comes with the router extra (and the dev extra)")
msgpack = pytest.importorskip("msgpack", reason="msgpack comes with the router extra (and the dev extra)")


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, hashes, parent, token_ids) -> None:
        self.events.append(("stored", list(hashes), parent, list(token_ids)))

    def removed(self, hashes) -> None:
        if hashes:
            self.events.append(("removed", list(hashes)))


def _index(snaps: int = 2) -> tuple[PrefixIndex, Recorder]:
    rec = Recorder()
    return PrefixIndex(BlockPool(64, 16, 4), list(range(4, 4 + snaps)), granule=reuse_granule(16), events=rec), rec


def _take(ix: PrefixIndex, tokens: list[int], pos: int):
    res = ix.pool.reserve(len(tokens) + 1)
    snap = ix.take(block_hashes(tokens, 16, pos), res.blocks, shared=False, tokens=tokens)
    ix.sent(snap)
    ix.pool.release(res)
    return snap


def test_blocks_joining_and_leaving_the_index_are_published():
    ix, rec = _index(snaps=2)
    turn1 = list(range(100))
    chain = block_hashes(turn1, 16, 64)
    _take(ix, turn1, 64)
    assert rec.events == [("stored", chain, None, turn1[:64])]
    # The conversation goes on: only the new blocks are stored, their parent the last block already held.
    turn2 = turn1 + list(range(100, 160))
    chain2 = block_hashes(turn2, 16, 128)
    _take(ix, turn2, 128)
    assert rec.events[-1] == ("stored", chain2[4:], chain2[3], turn2[64:128]) and chain2[:4] == chain
    # A third snapshot needs a slot: the superseded first one goes, but its blocks stay (the second covers them).
    other = list(range(500, 580))
    _take(ix, other, 64)
    assert rec.events[-1][0] == "stored" and not any(e[0] == "removed" for e in rec.events)
    # The next one evicts the second snapshot: its 8 blocks leave the index, all announced.
    _take(ix, list(range(700, 780)), 64)
    assert ("removed", chain2) in rec.events
    ix.clear()
    removed = [h for e in rec.events if e[0] == "removed" for h in e[1]]
    stored = [h for e in rec.events if e[0] == "stored" for h in e[1]]
    assert sorted(removed) == sorted(stored) and not ix.blocks  # every block stored was removed again


def test_wire_format_read_back_by_a_subscriber():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEvents(endpoint, block_size=16)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    try:
        h1, h2 = b"\x01" * 16, b"\x02" * 16
        deadline = time.monotonic() + 10
        while True:  # a PUB drops what it sends before the subscription arrives (ZMQ's slow joiner)
            pub.stored([h1, h2], None, list(range(32)))
            try:
                topic, seq, payload = sub.recv_multipart(flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                assert time.monotonic() < deadline, "no message reached the subscriber"
                time.sleep(0.05)
        pub.removed([h2])
        pub.cleared()
        frames = [(topic, seq, payload)]
        while len(frames) < 3:  # more copies of the first message may still be on their way: skip them
            frame = tuple(sub.recv_multipart())
            if msgpack.unpackb(frame[2], raw=False)[1][0]["type"] != "BlockStored":
                frames.append(frame)
    finally:
        sub.close()
        ctx.term()
        pub.close()
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert all(f[0] == b"" and len(f[1]) == 8 for f in frames) and seqs[0] < seqs[1] and seqs[2] == seqs[1] + 1
    batches = [msgpack.unpackb(f[2], raw=False) for f in frames]
    ts, events, rank = batches[0]
    assert abs(ts - time.time()) < 60 and rank is None
    assert events == [{"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
                       "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                       "lora_name": None}]
    assert batches[1][1] == [{"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU"}]
    assert batches[2][1] == [{"type": "AllBlocksCleared"}]


def test_bad_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="kv-events-endpoint"):
        KVEvents("nonsense://x", block_size=16)
