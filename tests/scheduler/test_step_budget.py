"""The round's token budget: its default follows the ranks' device, and a long prompt prefills in chunks as large as
the budget allows on the 64-token grid while the running streams' decode rows go first in every round."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.step_budget import DEFAULT_STEP_TOKENS, step_budget
from services.common.tensors import from_proto, to_proto
from services.scheduler.engine import EngineConfig
from services.scheduler.model_info import ModelInfo
from services.scheduler.round_output import RoundOutput
from services.scheduler.round_scheduler import RoundScheduler
from twinspark.v1 import generate_pb2, rank_pb2

INFO = ModelInfo(model="tiny", fingerprint="f", world=1, num_blocks=4096, block_size=16, num_slots=8, vocab_size=1000,
                 eos_ids=(999,), max_model_len=60_000)


def _msg(rid: str, n: int, max_tokens: int = 50) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(request_id=rid, prompt_ids=to_proto([5 + i % 900 for i in range(n)]),
                                        max_tokens=max_tokens)


def test_the_default_budget_is_the_devices():
    assert step_budget(None, "cuda") == DEFAULT_STEP_TOKENS["cuda"] == 8192
    assert step_budget(None, "cpu") == DEFAULT_STEP_TOKENS["cpu"] == 256
    assert step_budget(1000, "cuda") == 1000 and step_budget(None, "mps") == 256  # given wins; unknown: the CPU's


def test_the_ranks_device_comes_from_their_describe():
    d = rank_pb2.DescribeReply(model="m", fingerprint="f", world=1, num_blocks=8, block_size=16, num_slots=2,
                               vocab_size=10, max_model_len=128, settings={"device": "cuda"})
    assert ModelInfo.from_describe(d).device == "cuda"
    assert ModelInfo.from_describe(rank_pb2.DescribeReply(settings={})).device == "cpu"


@pytest.mark.parametrize("device,budget", [("cuda", None), ("cpu", 1024)])
def test_a_long_prompt_prefills_in_budget_sized_grid_chunks_after_the_decode_rows(device: str, budget: int | None):
    s = RoundScheduler(dataclasses.replace(INFO, device=device, step_budget=budget or 0),
                       EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget, enable_prefix_caching=False))
    size = step_budget(budget, device)
    streams = [s.add(_msg(f"s{i}", 64)) for i in range(3)]
    step = s.schedule()  # the three short prompts, whole
    s.sent(step)
    s.commit(step, RoundOutput([500] * len(from_proto(step.plan.sample_rows))))
    assert all(len(r.tokens) == 65 for r in streams)  # each prompt done and its first token sampled
    s.add(_msg("long", 3 * size + 100, max_tokens=1))
    chunks = []
    while True:
        step = s.schedule()
        p = step.plan
        rows = list(zip(p.request_ids, from_proto(p.starts).tolist(), from_proto(p.lengths).tolist()))
        assert [r[0] for r in rows[:3]] == ["s0", "s1", "s2"] and all(n == 1 for *_, n in rows[:3])  # decode first
        long = [r for r in rows if r[0] == "long"]
        s.sent(step)
        s.commit(step, RoundOutput([500] * len(from_proto(p.sample_rows))))
        if not long:
            break
        _, start, n = long[0]
        chunks.append(n)
        assert start % 64 == 0 and sum(n for *_, n in rows) <= size
        if start + n == 3 * size + 100:
            break
    # every chunk but the last fills the budget left after the 3 decode rows, cut down to the 64-token grid
    full = (size - 3) // 64 * 64
    assert chunks[:-1] == [full] * (len(chunks) - 1) and 0 < chunks[-1] <= full and sum(chunks) == 3 * size + 100


def test_the_scheduler_adopts_the_ranks_budget_and_refuses_a_larger_one():
    d = rank_pb2.DescribeReply(settings={"device": "cuda"}, max_num_batched_tokens=4096)
    info = ModelInfo.from_describe(d, [d, rank_pb2.DescribeReply(max_num_batched_tokens=2048)])
    assert info.step_budget == 2048  # the smallest of the group
    assert info.round_budget(None) == 2048 and info.round_budget(1024) == 1024
    with pytest.raises(ValueError, match="more than the 2048 the ranks sized their memory for"):
        info.round_budget(4096)
    # Ranks that do not report a budget: their device's default, as before.
    assert ModelInfo.from_describe(rank_pb2.DescribeReply(settings={"device": "cuda"})).round_budget(None) == 8192
