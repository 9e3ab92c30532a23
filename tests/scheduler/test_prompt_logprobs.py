"""Prompt logprobs in the scheduler (RoundScheduler alone, synchronously): a scoring request's prompt chunks carry
score rows (each row whose next token is a prompt token, with that token), their results go back as
PromptLogprobs events in prompt order before any token, max_tokens 0 prefills without sampling and finishes, and a
scoring request never resumes from the prefix cache."""

from __future__ import annotations

import pytest

from services.common.tensors import from_proto
from services.scheduler.engine import EngineConfig
from services.scheduler.request import State
from services.scheduler.round_output import PromptScores
from services.scheduler.round_output import RoundOutput
from services.scheduler.round_scheduler import RoundScheduler, ScheduledRound
from services.scheduler.validation import InvalidRequest
from tests.scheduler.test_round_scheduler import INFO, _msg
from twinspark.v1 import generate_pb2

PROMPT = [(7 * i) % 900 + 1 for i in range(150)]


def _sched(**cfg) -> RoundScheduler:
    return RoundScheduler(INFO, EngineConfig(**{"max_num_seqs": 2, "max_num_batched_tokens": 130,
                                                "enable_prefix_caching": False, **cfg}))


def _fake_scores(plan) -> PromptScores | None:
    """What a rank answers for the plan's score rows: logprob -row, rank 1 + row % 3, top ids [id, id + 1]."""
    if not plan.score_rows.shape:
        return None
    rows, ids = from_proto(plan.score_rows).tolist(), from_proto(plan.score_ids).tolist()
    k = plan.score_k
    return PromptScores([-float(r) for r in rows], [1 + r % 3 for r in rows], [[t + j for j in range(k)] for t in ids],
                        [[-0.5 * j for j in range(k)] for _ in ids])


def _run(s: RoundScheduler, token: int = 500) -> ScheduledRound:
    step = s.schedule()
    assert step is not None
    s.sent(step)
    s.commit(step, RoundOutput([token] * len(from_proto(step.plan.sample_rows)), scores=_fake_scores(step.plan)))
    return step


def _events(req) -> list[generate_pb2.GenerateEvent]:
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def test_score_rows_follow_the_prefill_chunks_and_come_back_in_order():
    s = _sched()
    req = s.add(_msg("a", PROMPT, max_tokens=2, prompt_logprobs=2))
    first = _run(s)  # [0, 128): the budget cut on the 64 grid; every row scored, nothing sampled
    assert from_proto(first.plan.score_rows).tolist() == list(range(128))
    assert from_proto(first.plan.score_ids).tolist() == PROMPT[1:129] and first.plan.score_k == 2
    assert not first.plan.sample_rows.shape or not first.plan.sample_rows.shape[0]
    second = _run(s)  # [128, 150): rows 128..148 scored, row 149 sampled
    assert from_proto(second.plan.score_rows).tolist() == list(range(21))
    assert from_proto(second.plan.score_ids).tolist() == PROMPT[129:150]
    assert from_proto(second.plan.sample_rows).tolist() == [21]
    _run(s)
    assert req.state is State.FINISHED and req.generated == [500, 500]
    events = _events(req)
    kinds = [e.WhichOneof("event") for e in events if e.WhichOneof("event") != "progress"]
    assert kinds == ["prompt_logprobs", "prompt_logprobs", "tokens", "tokens", "finished"]
    scores = [e.prompt_logprobs for e in events if e.WhichOneof("event") == "prompt_logprobs"]
    assert [p.start for p in scores] == [1, 129]
    assert from_proto(scores[0].logprobs).tolist() == [-float(r) for r in range(128)]
    assert from_proto(scores[1].top_ids).tolist()[0] == [PROMPT[129], PROMPT[129] + 1]
    assert from_proto(scores[1].ranks).tolist()[:3] == [1, 2, 3]


def test_max_tokens_0_scores_the_prompt_and_samples_nothing():
    s = _sched()
    req = s.add(_msg("z", PROMPT[:40], max_tokens=0, prompt_logprobs=0))
    step = _run(s)
    assert from_proto(step.plan.score_rows).tolist() == list(range(39))
    assert not step.plan.sample_rows.shape or not step.plan.sample_rows.shape[0]
    assert req.state is State.FINISHED and req.finished.reason == generate_pb2.FINISH_LENGTH
    assert req.finished.completion_tokens == 0 and s.schedule() is None
    kinds = [e.WhichOneof("event") for e in _events(req)]
    assert kinds[-2:] == ["prompt_logprobs", "finished"]


def test_a_scoring_request_never_resumes_from_the_prefix_cache():
    s = _sched(enable_prefix_caching=True, max_snapshots=2)
    _run_to_end(s, s.add(_msg("warm", PROMPT, max_tokens=1)))
    plain = s.add(_msg("plain", PROMPT, max_tokens=1))
    assert plain.cached_tokens == 128  # resumes at the prompt-end snapshot
    _run_to_end(s, plain)
    scoring = s.add(_msg("scoring", PROMPT, max_tokens=1, prompt_logprobs=1))
    assert scoring.cached_tokens == 0 and scoring.num_cached == 0
    step = s.schedule()
    assert step.seqs[0].start == 0 and len(from_proto(step.plan.score_rows)) == 128


def _run_to_end(s: RoundScheduler, req) -> None:
    while req.state is not State.FINISHED:
        _run(s)


@pytest.mark.parametrize("fields, code", [({"prompt_logprobs": 21}, "invalid_logprobs"),
                                          ({"prompt_logprobs": -1}, "invalid_logprobs"),
                                          ({"max_tokens": -1}, "invalid_max_tokens")])
def test_bad_prompt_logprobs_are_refused(fields, code):
    s = _sched()
    with pytest.raises(InvalidRequest, match=code):
        s.add(_msg("bad", PROMPT[:10], **{"max_tokens": 1, **fields}))
