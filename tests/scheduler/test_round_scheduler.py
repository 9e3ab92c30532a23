"""The RoundScheduler on its own: requests in, a round's plan from a given state, results back, synchronously (no
gRPC, no ranks, no event loop)."""

from __future__ import annotations

import pytest
import torch

from services.common.tensors import from_proto, to_proto
from services.scheduler.engine import EngineConfig
from services.scheduler.model_info import ModelInfo
from services.scheduler.request import PENDING_TOKEN, Request, State
from services.scheduler.round_output import RoundOutput
from services.scheduler.round_scheduler import RoundScheduler, ScheduledRound
from services.scheduler.validation import InvalidRequest
from twinspark.v1 import generate_pb2

EOS = 999
INFO = ModelInfo(model="tiny", fingerprint="f", world=1, num_blocks=64, block_size=16, num_slots=4, vocab_size=1000,
                 eos_ids=(EOS,), max_model_len=2048)


def _sched(**cfg) -> RoundScheduler:
    return RoundScheduler(INFO, EngineConfig(**{"max_num_seqs": 2, "max_num_batched_tokens": 130,
                                                "enable_prefix_caching": False, **cfg}))


def _msg(rid: str, prompt: list[int], max_tokens: int = 4, **fields) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(request_id=rid, prompt_ids=to_proto(prompt), max_tokens=max_tokens, **fields)


def _events(req: Request) -> list[str]:
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait().WhichOneof("event"))
    return out


def _rows(step: ScheduledRound) -> list[tuple[str, int, int]]:
    """(request id, start, length) of each planned sequence, in plan order."""
    p = step.plan
    return list(zip(p.request_ids, from_proto(p.starts).tolist(), from_proto(p.lengths).tolist()))


def _run(sched: RoundScheduler, token: int = 500) -> ScheduledRound:
    """Plan a round, send it, and commit `token` as every sample row's result."""
    step = sched.schedule()
    assert step is not None
    sched.sent(step)
    sched.commit(step, RoundOutput([token] * len(from_proto(step.plan.sample_rows))))
    return step


def test_a_plan_from_a_given_state_and_its_result_back():
    s = _sched()
    a = s.add(_msg("a", list(range(1, 101)), max_tokens=3))
    b = s.add(_msg("b", list(range(1, 11)), max_tokens=2))
    c = s.add(_msg("c", list(range(1, 6)), max_tokens=1))
    assert [r.id for r in s.running] == ["a", "b"] and [r.id for r in s.queue] == ["c"]  # two may run at once
    step = s.schedule()
    assert step is not None and step.number == 1
    assert _rows(step) == [("a", 0, 100), ("b", 0, 10)]  # both prompts fit the 130-token budget whole
    assert from_proto(step.plan.sample_rows).tolist() == [99, 109] and from_proto(step.plan.slots).tolist() == [0, 1]
    s.sent(step)
    s.commit(step, RoundOutput([7, EOS]))
    assert a.generated == [7] and b.state is State.FINISHED and b.finished.reason == generate_pb2.FINISH_STOP
    assert _events(b) == ["progress", "tokens", "finished"] and "b" not in s.live
    s.admit()  # the loop admits at the top of every turn
    assert c.state is State.RUNNING and c.reservation.slot == 2  # b's slot went to the back of the free list
    step = s.schedule()
    assert _rows(step) == [("a", 100, 1), ("c", 0, 5)]  # a decode row first, then c's prompt
    assert from_proto(step.plan.token_ids).tolist()[0] == 7  # the last sampled token is fed back


def test_a_round_planned_while_the_last_is_in_flight_says_pending_token():
    s = _sched()
    a = s.add(_msg("a", [1, 2, 3], max_tokens=5))
    first = s.schedule()
    s.sent(first)
    s.sent(second := s.schedule())  # planned before the first round's sample is back
    assert _rows(second) == [("a", 3, 1)] and from_proto(second.plan.token_ids).tolist() == [PENDING_TOKEN]
    assert (a.pending_rows, a.pending_samples) == (4, 2)
    s.commit(first, RoundOutput([11]))
    s.commit(second, RoundOutput([12]))
    assert a.generated == [11, 12] and a.pending_rows == 0


def test_abort_of_a_running_request_frees_it_once_its_rows_are_back():
    s = _sched()
    a = s.add(_msg("a", [1, 2, 3]))
    step = s.schedule()
    s.sent(step)
    assert s.abort("a", "test") and not s.abort("nobody")
    free = s.kv.pool.free_slots
    s.reap_aborted()  # the loop reaps it, but its rows are still in flight: the slot is kept for them
    assert a.state is State.FINISHED and a.finished.reason == generate_pb2.FINISH_ABORTED
    assert s.kv.pool.free_slots == free and a.release_deferred
    s.commit(step, RoundOutput([5]))
    assert s.kv.pool.free_slots == free + 1 and a.generated == []  # its sample is dropped


def test_a_resent_prompt_resumes_from_the_snapshot_its_first_prefill_took():
    s = _sched(enable_prefix_caching=True, max_snapshots=2, max_num_batched_tokens=200)
    prompt = list(range(1, 131))
    a = s.add(_msg("a", prompt, max_tokens=1))
    first = _run(s)
    assert _rows(first) == [("a", 0, 128)]  # the chunk ends at the snapshot point, 128, and samples nothing
    second = _run(s, 5)
    assert _rows(second) == [("a", 128, 2)]
    assert from_proto(second.plan.state_copies).tolist() == [[0, 2]]  # request slot 0 -> snapshot slot 2 at 128
    assert a.state is State.FINISHED
    b = s.add(_msg("b", prompt, max_tokens=1))
    assert b.cached_tokens == 128 and b.num_cached == 128
    step = s.schedule()
    # snapshot slot 2 -> b's slot (1: a's slot 0 went to the back of the free list)
    assert _rows(step) == [("b", 128, 2)] and from_proto(step.plan.state_copies).tolist() == [[2, 1]]
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (260, 128)


def test_a_replayed_reply_lets_the_next_turn_resume_past_it():
    s = _sched(enable_prefix_caching=True, max_snapshots=2, max_num_batched_tokens=200, reply_reuse_delay=0.0)
    a = s.add(_msg("a", list(range(1, 121)), max_tokens=10))
    while a.state is not State.FINISHED:
        _run(s)
    assert [r.id for r in s.running] == ["a:reply"] and s.num_running == 0  # cache upkeep, not a request
    # What only the replay and the prefix index hold counts as free: all of it (the prompt's 4 blocks are both's).
    assert s.pool_stats().free_blocks == INFO.num_blocks
    replay = _run(s)
    assert _rows(replay) == [("a:reply", 64, 64)] and not s.running  # from the prompt's snapshot to the grid point
    b = s.add(_msg("b", a.tokens + [7] * 5, max_tokens=1))
    assert b.cached_tokens == 128  # past the prompt, into the reply
    step = s.schedule()
    assert from_proto(step.plan.state_copies).tolist() == [[0, 3], [3, 1]]  # the replay's snapshot, then b's resume


def test_a_replay_waits_until_no_request_has_run_or_waited_for_the_delay():
    """A replay is held while users' requests run and for --reply-reuse-delay after: a request that comes at once
    is planned alone, not behind a replay (the served whole model's TTFT at concurrency 1 paid one each time)."""
    clock = [100.0]
    s = RoundScheduler(INFO, EngineConfig(max_num_seqs=2, max_num_batched_tokens=200, enable_prefix_caching=True,
                                          max_snapshots=2, reply_reuse_delay=0.5), clock=lambda: clock[0])
    a = s.add(_msg("a", list(range(1, 121)), max_tokens=10))
    while a.state is not State.FINISHED:
        _run(s)
    assert [r.id for r in s.running] == ["a:reply"]
    assert s.schedule() is None and s.replay_wait() == 0.5  # held: a request ran just now
    clock[0] += 0.2
    b = s.add(_msg("b", [1, 2, 3], max_tokens=2))
    s.admit()
    assert _rows(_run(s)) == [("b", 0, 3)]  # the newcomer goes alone
    while b.state is not State.FINISHED:
        _run(s)
    assert s.schedule() is None and s.replay_wait() == 0.5  # held again from b's last round
    clock[0] += 0.5
    assert s.replay_wait() == 0.0
    assert _rows(_run(s)) == [("a:reply", 64, 64)]  # idle long enough: the replay runs


def test_a_replay_gives_its_slot_to_a_waiting_request():
    s = _sched(enable_prefix_caching=True, max_snapshots=2, max_num_seqs=1, max_num_batched_tokens=200)
    a = s.add(_msg("a", list(range(1, 121)), max_tokens=10))
    while a.state is not State.FINISHED:
        _run(s)
    assert [r.id for r in s.running] == ["a:reply"]
    b = s.add(_msg("b", [1, 2, 3]))
    assert [r.id for r in s.running] == ["b"] and s.kv.pool.free_slots == 1  # the replay's slot came back


def test_drafts_and_what_keeps_rounds_from_overlapping():
    s = _sched(max_num_seqs=3)
    a = s.add(_msg("a", [1, 2, 3], max_tokens=3))
    s.add(_msg("b", [1, 2, 3], max_tokens=8, no_draft=True))
    assert s.draft_wants() == []  # still prefilling
    _run(s, 4)
    assert [(r.id, k) for r, k in s.draft_wants()] == [("a", 1)]  # 2 tokens left: 1 draft + the bonus token
    step = s.schedule({"a": [9]})
    assert _rows(step)[0] == ("a", 3, 2) and from_proto(step.plan.verify).tolist() == [1, 0]
    assert not s.reads_last_samples
    sp = generate_pb2.Sampling(presence_penalty=0.5)
    s.add(_msg("c", [1, 2, 3], sampling=sp))
    assert s.reads_last_samples  # its next row counts the tokens it generated


def test_a_refused_request_leaves_no_trace():
    s = _sched()
    with pytest.raises(InvalidRequest, match="invalid_sampling"):
        s.add(_msg("x", [1, 2, 3], sampling=generate_pb2.Sampling(temperature=-1.0)))
    assert not s.live and not len(s.queue) and not s.running
    s.add(_msg("x", [1, 2, 3]))  # the id is free


def _commit_with_layers(sched: RoundScheduler, step: ScheduledRound, sampled: list[int],
                        accepted: list[int] | None = None) -> None:
    """Commit a round whose layer rows hold their own absolute position (so the test can read which were kept)."""
    p = step.plan
    positions = [s + i for s, n in zip(from_proto(p.starts).tolist(), from_proto(p.lengths).tolist())
                 for i in range(n)]
    sched.sent(step)
    layers = torch.tensor(positions, dtype=torch.float32)[:, None]
    sched.commit(step, RoundOutput(sampled, accepted=accepted, layers=layers))


def test_dflash_context_rows_are_kept_by_position_until_delivered():
    s = _sched(max_num_seqs=3)
    a = s.add(_msg("a", list(range(1, 101)), max_tokens=8))
    b = s.add(_msg("b", [1, 2, 3], max_tokens=8, no_draft=True))
    step = s.schedule()
    _commit_with_layers(s, step, [7, 7])  # both prompts whole
    step = s.schedule()
    _commit_with_layers(s, step, [8, 8])  # a decode row each
    step = s.schedule({"a": [5, 6, 9]})
    assert _rows(step)[0] == ("a", 101, 4)
    _commit_with_layers(s, step, [5, 1, 2, 3, 8], accepted=[1, 0])  # the first draft accepted, then the bonus 1
    assert a.tokens[-3:] == [8, 5, 1]
    rows = a.draft_rows.pending(1 << 20)
    # The prompt, the decode row and the window's last committed token + accepted draft: every position before the
    # last token's, in order; the rejected drafts' rows are not context.
    assert a.draft_rows.start == 0 and rows is not None and rows[:, 0].tolist() == list(range(len(a.tokens) - 1))
    a.draft_rows.delivered(rows.shape[0])
    assert a.draft_rows.pending(1 << 20) is None and a.draft_rows.start == len(a.tokens) - 1
    assert b.draft_rows.pending(1 << 20) is None  # no drafts asked, no rows kept
