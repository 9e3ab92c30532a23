"""The thinking budget in the scheduler: what is forced at which row (thinking.py), the masks a round carries for
it with and without a grammar and drafts (round_masks.py), the overlap it keeps, and whole requests through the
real scheduler against stand-in ranks that sample under the masks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.tensors import from_proto, to_proto
from services.scheduler.batcher import PlannedSeq
from services.scheduler.engine import EngineConfig
from services.scheduler.grammar import GrammarBook, allows
from services.scheduler.model_info import ModelInfo
from services.scheduler.round_masks import one_token_mask
from services.scheduler.round_output import RoundOutput
from services.scheduler.round_scheduler import RoundScheduler
from services.scheduler.thinking import ThinkingBudget, ThinkingSpec
from services.scheduler.validation import InvalidRequest
from tests.scheduler.harness import cluster, collect, make_request
from tests.scheduler.standin_rank import standin_generate
from twinspark.v1 import generate_pb2

EOS = 999
END, TOOL = 7, 8  # "</think>" and "<tool_call>" of these tests
MSG = (41, 42)  # a forced message's ids
INFO = ModelInfo(model="tiny", fingerprint="f", world=1, num_blocks=64, block_size=16, num_slots=4, vocab_size=1000,
                 eos_ids=(EOS,), max_model_len=2048)


def _budget(budget: int = 3, message: tuple[int, ...] = MSG) -> ThinkingBudget:
    return ThinkingBudget(ThinkingSpec(budget=budget, forced=(*message, END), ends=frozenset({END, TOOL})))


def _proto(budget: int = 3, message: tuple[int, ...] = MSG) -> generate_pb2.ThinkingBudget:
    return generate_pb2.ThinkingBudget(budget=budget, forced_ids=[*message, END], end_ids=[END, TOOL])


def _allowed(mask) -> list[int]:
    return [t for t in range(32 * mask.numel()) if allows(mask, t)]


# -------------------------------------------------------------------------------------------- what is forced

def test_the_budget_then_the_message_then_the_end_are_forced():
    th = _budget()
    forced = []
    for token in (100, 101, 102, 41, 42, END, 103):  # the model's own 3, then what the rows force
        forced.append(th.window(0, [])[0][0])
        assert th.commit([token]) is None
    assert forced == [None, None, None, 41, 42, END, None] and th.ended


@pytest.mark.parametrize("own_end", [END, TOOL])
def test_a_thinking_that_ends_first_forces_nothing(own_end: int):
    """The model's own </think>, or a tool call's opening: nothing is forced afterwards, never into the call."""
    th = _budget(budget=2)
    assert th.commit([100, own_end]) is None
    for _ in range(5):
        assert th.window(0, [])[0] == [None]
        assert th.commit([TOOL + 100]) is None


def test_budget_zero_forces_at_once_and_a_wrong_sample_is_an_error():
    th = _budget(budget=0, message=())
    assert th.window(0, [])[0] == [END]
    assert th.commit([5]) == f"thinking budget: token 5 was sampled where {END} was forced"


def test_drafts_past_the_budget_are_kept_only_where_they_are_the_forced_tokens():
    th = _budget(budget=2)
    assert th.commit([100]) is None
    # Rows: index 1 (free), 2 (forces 41), 3 (forces 42), 4 (forces END), 5 (free: thinking ended).
    assert th.window(0, [200, 41, 42, END]) == ([None, 41, 42, END, None], 4)
    assert th.window(0, [200, 41, 99, END]) == ([None, 41, 42], 2)  # 99 is not the forced 42: cut there
    assert th.window(0, [END, 5, 6]) == ([None, None, None, None], 3)  # the drafts end thinking themselves


def test_only_a_row_that_may_be_forced_waits_for_the_samples_in_flight():
    th = _budget(budget=4)
    assert th.commit([100]) is None
    assert not th.needs_samples(0)
    assert not th.needs_samples(2)  # the next row is index 3: before the budget, whatever the samples were
    assert th.window(2, []) == ([None], 0)
    assert th.needs_samples(3)  # index 4 is forced unless one of the 3 in flight ends thinking
    with pytest.raises(AssertionError):
        th.window(3, [])


# --------------------------------------------------------------------------------------------- a round's masks

def _sched(**cfg) -> RoundScheduler:
    return RoundScheduler(INFO, EngineConfig(**{"max_num_seqs": 2, "max_num_batched_tokens": 130,
                                                "enable_prefix_caching": False, **cfg}))


def _msg(rid: str, prompt: list[int], max_tokens: int = 12, **fields) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(request_id=rid, prompt_ids=to_proto(prompt), max_tokens=max_tokens, **fields)


def _masks(plan) -> list[list[int] | None]:
    if not plan.HasField("mask_index"):
        return [None] * len(from_proto(plan.sample_rows))
    bitmask = from_proto(plan.bitmask)
    return [_allowed(bitmask[i]) if i >= 0 else None for i in from_proto(plan.mask_index).tolist()]


def test_a_forced_row_carries_a_mask_of_its_token_alone_and_the_others_none():
    s = _sched()
    req = s.add(_msg("a", [1, 2, 3], thinking=_proto(budget=1)))
    seen = []
    for token in (100, 41, 42, END, 101):
        step = s.schedule()
        seen.append(_masks(step.plan))
        s.sent(step)
        s.commit(step, RoundOutput([token]))
    # The prompt's row samples index 0 (free), index 1.. are forced, and after the end the rows are free again.
    assert seen == [[None], [[41]], [[42]], [[END]], [None]]
    assert req.generated == [100, 41, 42, END, 101] and req.thinking.ended


def test_a_rank_that_ignores_the_forced_mask_fails_the_request():
    s = _sched()
    req = s.add(_msg("a", [1, 2, 3], thinking=_proto(budget=0, message=())))
    step = s.schedule()
    s.sent(step)
    s.commit(step, RoundOutput([5]))
    assert req.finished is not None and req.finished.reason == generate_pb2.FINISH_ERROR
    assert req.finished.error == f"thinking budget: token 5 was sampled where {END} was forced"


def test_a_verify_window_keeps_the_forced_drafts_and_masks_each_row():
    s = _sched()
    req = s.add(_msg("a", [1, 2, 3], thinking=_proto(budget=2)))
    for token in (100, 101):
        step = s.schedule()
        s.sent(step)
        s.commit(step, RoundOutput([token]))
    assert req.generated == [100, 101]
    step = s.schedule({"a": [41, 42, 55]})  # the drafter guessed the message, then not the end
    seq = step.seqs[0]
    assert seq.verify and seq.token_ids == [101, 41, 42]  # 55 is not the forced END: cut
    assert _masks(step.plan) == [[41], [42], [END]]


def test_overlapped_rounds_stop_only_where_a_row_may_be_forced():
    s = _sched()
    s.add(_msg("a", [1, 2, 3], thinking=_proto(budget=3)))
    step = s.schedule()
    s.sent(step)  # the prompt round in flight: its sample is index 0
    assert not s.reads_last_samples  # the next row is index 1 < 3
    s.sent(s.schedule())  # index 1 in flight too
    s.sent(s.schedule())  # index 2
    assert s.reads_last_samples  # index 3 is forced unless one of the three ends thinking


# ---------------------------------------------------------------------------------------- with a grammar

def _reply_grammar(tiny: Path) -> str:
    """The gateway's reply grammar with reasoning: free thinking up to </think>, a newline, then "yes" or "no"."""
    head = "start: THINK </think> NL @body\nTHINK: /(?s:.*)/\nNL: /\\n/\n"
    return json.dumps({"grammars": [{"name": "reply", "lark_grammar": head},
                                    {"name": "body", "lark_grammar": 'start: "yes" | "no"'}]})


def test_with_a_grammar_the_forced_rows_are_the_forced_token_and_the_grammar_follows(tiny_default: Path):
    vocab, end = 1088, 1017  # the tiny checkpoint's vocabulary and </think>
    book = GrammarBook.load(str(tiny_default), vocab, [1000])
    info = ModelInfo(model="tiny", fingerprint="f", world=1, num_blocks=64, block_size=16, num_slots=4,
                     vocab_size=vocab, eos_ids=(1000,), max_model_len=2048)
    s = RoundScheduler(info, EngineConfig(max_num_seqs=2, max_num_batched_tokens=130, enable_prefix_caching=False),
                       grammars=book)
    thinking = generate_pb2.ThinkingBudget(budget=2, forced_ids=[end], end_ids=[end, 1018])
    req = s.add(_msg("a", [1, 2, 3], grammar=_reply_grammar(tiny_default), thinking=thinking))
    for token in (72, 306):  # two thinking tokens the grammar allows
        step = s.schedule()
        allowed = _masks(step.plan)[0]
        assert allowed is not None and token in allowed and end in allowed
        s.sent(step)
        s.commit(step, RoundOutput([token]))
    step = s.schedule()
    assert _masks(step.plan) == [[end]]  # forced, and the grammar allows it
    s.sent(step)
    s.commit(step, RoundOutput([end]))
    step = s.schedule()
    assert _masks(step.plan) == [[198]]  # the grammar's newline after the think block
    assert req.finished is None


def test_a_forced_row_and_a_grammar_row_share_one_plan(tiny_default: Path):
    """A thinking-only request's forced mask and another request's grammar mask stack into one bitmask."""
    vocab, end = 1088, 1017
    book = GrammarBook.load(str(tiny_default), vocab, [1000])
    info = ModelInfo(model="tiny", fingerprint="f", world=1, num_blocks=64, block_size=16, num_slots=4,
                     vocab_size=vocab, eos_ids=(1000,), max_model_len=2048)
    s = RoundScheduler(info, EngineConfig(max_num_seqs=2, max_num_batched_tokens=130, enable_prefix_caching=False),
                       grammars=book)
    s.add(_msg("g", [1, 2, 3], grammar=_reply_grammar(tiny_default)))
    s.add(_msg("t", [4, 5, 6], thinking=generate_pb2.ThinkingBudget(budget=0, forced_ids=[end], end_ids=[end])))
    step = s.schedule()
    masks = _masks(step.plan)
    assert masks[1] == [end] and end in masks[0] and 72 in masks[0]
    assert from_proto(step.plan.bitmask).shape[1] == len(book.compile(_reply_grammar(tiny_default)).mask())


def test_a_grammar_that_forbids_the_forced_token_ends_as_invalid_grammar(tiny_default: Path):
    vocab, end = 1088, 1017
    book = GrammarBook.load(str(tiny_default), vocab, [1000])
    info = ModelInfo(model="tiny", fingerprint="f", world=1, num_blocks=64, block_size=16, num_slots=4,
                     vocab_size=vocab, eos_ids=(1000,), max_model_len=2048)
    s = RoundScheduler(info, EngineConfig(max_num_seqs=2, max_num_batched_tokens=130, enable_prefix_caching=False),
                       grammars=book)
    grammar = json.dumps({"grammars": [{"lark_grammar": 'start: "yes" | "no"'}]})  # no think block at all
    req = s.add(_msg("a", [1, 2, 3], grammar=grammar,
                     thinking=generate_pb2.ThinkingBudget(budget=0, forced_ids=[end], end_ids=[end])))
    step = s.schedule()
    allowed = _masks(step.plan)[0]
    assert allowed is not None and end not in allowed  # the grammar's own mask, not an empty one
    s.sent(step)
    s.commit(step, RoundOutput([allowed[0]]))
    assert req.finished.reason == generate_pb2.FINISH_ERROR and req.finished.error.startswith("invalid_grammar: ")


def test_one_token_masks_cover_every_bit_of_a_word():
    for token in (0, 31, 32, 63, 999):
        assert _allowed(one_token_mask(token, 1000)) == [token]


@pytest.mark.parametrize("thinking, says", [
    (generate_pb2.ThinkingBudget(budget=-1, forced_ids=[END], end_ids=[END]), ">= 0"),
    (generate_pb2.ThinkingBudget(budget=1, forced_ids=[], end_ids=[END]), "forced_ids"),
    (generate_pb2.ThinkingBudget(budget=1, forced_ids=[41], end_ids=[END]), "must end with"),
    (generate_pb2.ThinkingBudget(budget=1, forced_ids=[END, END], end_ids=[END]), "must end with"),
    (generate_pb2.ThinkingBudget(budget=1, forced_ids=[5000], end_ids=[5000]), "vocabulary"),
])
def test_a_bad_thinking_budget_is_refused(thinking, says):
    with pytest.raises(InvalidRequest, match="invalid_thinking") as err:
        _sched().add(_msg("a", [1, 2, 3], thinking=thinking))
    assert says in str(err.value)


def test_planned_seq_masks_reach_the_plan_per_row():
    """A window whose rows are partly masked: -1 for the free row, one bitmask row per forced row."""
    s = _sched()
    s.add(_msg("a", [1, 2, 3], thinking=_proto(budget=2)))
    step = s.schedule()
    s.sent(step)
    s.commit(step, RoundOutput([100]))
    step = s.schedule({"a": [101, 41]})  # rows: index 1 (free), 2 (forces 41: the draft is kept), 3 (forces 42)
    assert from_proto(step.plan.mask_index).tolist() == [-1, 0, 1]
    assert isinstance(step.seqs[0], PlannedSeq) and step.seqs[0].token_ids == [100, 101, 41]


# -------------------------------------------------------------------------- whole requests through the scheduler

def _alone(prompt: list[int], max_tokens: int, budget: int, vocab: int) -> list[int]:
    """What the stand-in produces for one request under a budget: its own tokens, then the forced ones."""
    own, _, _ = standin_generate(prompt, budget, vocab=vocab)
    out = own[:budget]
    if not {END, TOOL} & set(out):
        out += [*MSG, END]
    return out[:max_tokens]


def test_requests_under_budgets_alone_and_in_a_burst_through_the_scheduler():
    vocab = 1000
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3], [9, 9, 9]]
    budgets = [0, 1, 4, 9]

    async def body() -> tuple[list[list[int]], list[list[int]], int]:
        async with cluster(1, rank=dict(vocab=vocab, apply_masks=True, num_slots=8), max_num_seqs=8,
                           max_num_batched_tokens=256) as c:
            def call(i: int, rid: str):
                return c.stub.Generate(make_request(prompts[i], 12, rid=rid, thinking=_proto(budget=budgets[i])),
                                       timeout=20)
            alone = [(await collect(call(i, f"alone{i}"))).tokens for i in range(len(prompts))]
            burst = await asyncio.gather(*(collect(call(i, f"burst{i}")) for i in range(len(prompts))))
            return alone, [r.tokens for r in burst], c.ranks[0].pending_filled

    alone, burst, pipelined = asyncio.run(body())
    for p, b, got in zip(prompts, budgets, alone):
        want = _alone(p, 12, b, vocab)
        assert got[: len(want)] == want
    assert burst == alone
    assert pipelined > 0  # rows before the budget kept the rounds overlapped
