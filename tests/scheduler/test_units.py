"""The scheduler's parts alone: pool, budget policy, plan packing, checksum, admission, seeds, CLI."""

from __future__ import annotations

import argparse

import pytest

from services.common.plan_checksum import plan_checksum, seal, verify
from services.common.tensors import from_proto
from services.scheduler import cli
from services.scheduler.admission import AdmissionQueue, QueueFull
from services.scheduler.batcher import build_step_plan, plan_round
from services.scheduler.pool import BlockPool, PoolExhausted
from services.scheduler.request import Request, SamplingSpec, State, derive_seed
from twinspark.v1 import generate_pb2

BG = generate_pb2.PRIORITY_BACKGROUND


def _req(rid: str, prompt_len: int, *, order: int, priority: int = 0, cached: int = 0, generated: int = 0,
         seed: int = 1) -> Request:
    r = Request(request_id=rid, prompt=list(range(1, prompt_len + 1)), max_tokens=50,
                sampling=SamplingSpec(0.5, 0.9, 7, 0.01, seed), stop_ids=frozenset(), eos_ids=frozenset(),
                priority=priority, order=order, max_model_len=1000)
    r.tokens += [500 + i for i in range(generated)]
    r.num_cached = cached
    r.state = State.RUNNING
    return r


def test_pool_reserves_all_or_nothing_and_refcounts():
    pool = BlockPool(num_blocks=6, block_size=4, num_slots=2)
    a = pool.reserve(9)  # 3 blocks
    assert (a.blocks, a.slot, pool.free_blocks, pool.free_slots) == ([0, 1, 2], 0, 3, 1)
    assert not pool.can_reserve(13) and pool.can_reserve(12)
    with pytest.raises(PoolExhausted):
        pool.reserve(13)
    assert pool.free_blocks == 3  # a failed reservation takes nothing
    b = pool.reserve(4)
    assert not pool.can_reserve(1)  # blocks left, but no slot
    pool.share(a.blocks[0])  # a prefix index would hold this block
    pool.release(a)
    pool.release(a)  # idempotent
    assert pool.refcount(0) == 1 and pool.free_blocks == 4 and pool.free_slots == 1
    pool.release(b)
    assert pool.fits_ever(24) and not pool.fits_ever(25)
    c = pool.reserve(8)
    assert c.blocks == [4, 5]  # least recently freed first
    with pytest.raises(ValueError):
        pool.share(1)


def test_plan_round_decodes_first_then_prefill_fcfs_under_budget():
    d1 = _req("d1", 4, order=0, cached=4, generated=1)
    d2 = _req("d2", 4, order=1, cached=5, generated=2, priority=BG)
    p_bg = _req("pbg", 30, order=2, priority=BG)
    p1 = _req("p1", 30, order=3, cached=10)
    p2 = _req("p2", 5, order=4)
    seqs = plan_round([p_bg, p2, d2, p1, d1], budget=27)
    got = [(s.req.id, s.start, len(s.token_ids), s.sample, s.prompt) for s in seqs]
    assert got == [("d1", 4, 1, True, False), ("d2", 5, 1, True, False), ("p1", 10, 20, True, True),
                   ("p2", 0, 5, True, True)]
    assert seqs[0].token_ids == [500] and seqs[1].token_ids == [501]  # the last sampled token is fed back
    assert seqs[2].token_ids == list(range(11, 31))
    # 4 tokens left for p2's 5-token prompt: a chunk would end off the 64 grid, so p2 waits.
    assert [s.req.id for s in plan_round([p_bg, p2, d2, p1, d1], budget=26)] == ["d1", "d2", "p1"]
    # Budget below the decoders: the least recently served go first.
    d1.last_round, d2.last_round = 5, 4
    assert [s.req.id for s in plan_round([d1, d2], budget=1)] == ["d1"]  # normal before background
    d3 = _req("d3", 4, order=5, cached=4, generated=1)
    d3.last_round = 3
    assert [s.req.id for s in plan_round([d1, d3], budget=1)] == ["d3"]


def test_prompt_chunks_end_on_the_kda_grid():
    long = _req("long", 300, order=0, cached=64)
    seqs = plan_round([long], budget=150)  # reaches 214: cut at 192, the last multiple of 64
    assert [(s.start, len(s.token_ids), s.sample) for s in seqs] == [(64, 128, False)]
    assert plan_round([long], budget=60) == []  # cannot reach 128: waits rather than leave the grid
    long.snap_points = [(128, True)]  # a snapshot point (a multiple of 64) stops the chunk first
    assert [(s.start, len(s.token_ids)) for s in plan_round([long], budget=150)] == [(64, 64)]
    # drafts leave a whole grid chunk for a waiting prompt
    d = _req("d", 4, order=1, cached=4, generated=1)
    seqs = plan_round([d, long], budget=100, drafts={"d": list(range(90))})
    assert [(s.req.id, len(s.token_ids)) for s in seqs] == [("d", 36), ("long", 64)]


def test_step_plan_packing():
    pool = BlockPool(num_blocks=40, block_size=4, num_slots=4)
    d = _req("d", 6, order=0, cached=6, generated=1, seed=2**64 - 1)
    p = _req("p", 7, order=1)
    d.reservation, p.reservation = pool.reserve(d.reserve_tokens), pool.reserve(p.reserve_tokens)
    plan = build_step_plan(plan_round([p, d], budget=8), block_size=4)
    assert from_proto(plan.token_ids).tolist() == [500, 1, 2, 3, 4, 5, 6, 7]
    assert from_proto(plan.starts).tolist() == [6, 0] and from_proto(plan.lengths).tolist() == [1, 7]
    assert from_proto(plan.slots).tolist() == [0, 1] and from_proto(plan.prompt).tolist() == [0, 1]
    tables = from_proto(plan.block_tables)
    assert tables.shape == (2, 2) and tables.tolist() == [d.reservation.blocks[:2], p.reservation.blocks[:2]]
    assert from_proto(plan.sample_rows).tolist() == [0, 7]  # d's decode row and the end of p's prompt
    assert from_proto(plan.seed).tolist() == [-1, 1]  # u64 bits carried as int64
    assert from_proto(plan.top_k).tolist() == [7, 7] and list(plan.request_ids) == ["d", "p"]
    seal(plan)
    assert verify(plan) and plan.checksum == plan_checksum(plan)
    plan.round += 1
    assert not verify(plan)


def test_admission_order_and_retry_after():
    q = AdmissionQueue(max_waiting=3)
    reqs = [_req("a", 3, order=0, priority=BG), _req("b", 3, order=1), _req("c", 3, order=2)]
    for r in reqs:
        q.push(r, capacity=2)
    with pytest.raises(QueueFull) as err:
        q.push(_req("d", 3, order=3), capacity=2)
    assert err.value.retry_after_s >= 1
    assert [q.pop_head().id for _ in range(3)] == ["b", "c", "a"]
    for _ in range(30):
        q.record_service(10.0)
    assert q.retry_after(capacity=1) >= 9


def test_seed_is_derived_from_the_prompt():
    assert derive_seed([1, 2, 3]) == derive_seed([1, 2, 3]) != derive_seed([1, 2, 4])
    assert 0 <= derive_seed([5]) < 2**64
    assert SamplingSpec(0, 1, 0, 0, 2**63).seed_i64 == -(2**63)


def test_cli_flags_and_env_defaults(monkeypatch, capsys):
    monkeypatch.setenv("TWINSPARK_RANKS", "h0:1,h1:2")
    monkeypatch.setenv("TWINSPARK_MAX_NUM_SEQS", "4")
    parser = argparse.ArgumentParser(prog="twinspark")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve-scheduler", "--max-num-batched-tokens", "64"])
    assert (args.ranks, args.port, args.max_waiting, args.max_num_seqs, args.max_num_batched_tokens) == \
        ("h0:1,h1:2", 50051, 64, 4, 64)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["serve-scheduler", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(f in out for f in ("--ranks", "--max-waiting", "--max-num-seqs", "--max-num-batched-tokens",
                                  "--log-level", "--host", "--port"))


def test_verify_window_rows_count_the_drafts_before_them():
    """Row j of a verify window follows drafts 1..j (taken as accepted): its counts and min_tokens ban include them."""
    from services.scheduler.batcher import PlannedSeq
    from services.scheduler.penalties import PenaltySpec, PenaltyState

    pool = BlockPool(num_blocks=40, block_size=4, num_slots=4)
    d = _req("d", 6, order=0, cached=7, generated=2)  # generated [500, 501]
    d.penalties = PenaltyState(PenaltySpec(presence=1.0, repetition=1.5, min_tokens=4), d.tokens[:6])
    d.penalties.counts.update(d.generated)
    d.eos_ids = frozenset({9})
    d.reservation = pool.reserve(d.reserve_tokens)
    plan = build_step_plan([PlannedSeq(d, 7, [501, 500, 77, 500], sample=True, verify=True)], block_size=4)
    pen = plan.penalties
    assert from_proto(pen.rows).tolist() == [0, 1, 2, 3]
    rows = [dict((t, c) for t, c in zip(i, n) if t >= 0)
            for i, n in zip(from_proto(pen.seen_ids).tolist(), from_proto(pen.seen_counts).tolist())]
    prompt = {t: 0 for t in range(1, 7)}  # repetition is on: the prompt's ids ride along with count 0
    assert rows == [{**prompt, 500: 1, 501: 1}, {**prompt, 500: 2, 501: 1}, {**prompt, 500: 2, 501: 1, 77: 1},
                    {**prompt, 500: 3, 501: 1, 77: 1}]
    assert from_proto(pen.banned_ids).tolist() == [[9], [9], [-1], [-1]]  # 2, 3 tokens before: banned; 4, 5: free
    assert from_proto(pen.repetition).tolist() == [1.5] * 4


def test_a_reply_replay_only_prefills():
    """A replay (prompt + reply recomputed for the prefix cache) samples nothing: once its last chunk is in flight,
    a round planned before that chunk is back gives it no decode row (which would write past its blocks)."""
    rep = _req("r:reply", 128, order=0, cached=64)
    rep.replay, rep.max_tokens = True, 1
    seqs = plan_round([rep], budget=256)
    assert [(s.start, len(s.token_ids), s.sample) for s in seqs] == [(64, 64, False)]
    rep.plan_rows(seqs[0])
    assert plan_round([rep], budget=256) == []


def test_an_image_split_over_two_chunks_goes_to_both_with_its_digest():
    """Each chunk holding some of an image's placeholders carries the image, which rows get which embeddings, and the
    request's digest (rank 0 keeps the tower's output under it, so the second chunk does not encode it again)."""
    pool = BlockPool(num_blocks=40, block_size=4, num_slots=4)
    r = _req("img", 20, order=0)
    r.images = [generate_pb2.Image(digest=b"\x01" * 32, offset=5, tokens=10)]
    r.reservation = pool.reserve(r.reserve_tokens)
    seqs = plan_round([r], budget=8, align=4)
    first = build_step_plan(seqs, block_size=4)
    assert [(i.row, i.first, i.count, i.digest) for i in first.images] == [(5, 0, 3, b"\x01" * 32)]
    r.plan_rows(seqs[0])  # sent: the next round plans the rows after it
    second = build_step_plan(plan_round([r], budget=8, align=4), block_size=4)
    assert [(i.row, i.first, i.count, i.digest) for i in second.images] == [(0, 3, 7, b"\x01" * 32)]
