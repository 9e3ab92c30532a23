"""The rank's overlapped rounds on CUDA (services/rank_worker/server.py, Executor.launch / finish): launching a
decode round queues its work without waiting for the GPU (torch's sync debug mode turns any wait into an error),
and two sequences decoded with round n+1 launched before round n is read back (its input a PENDING_TOKEN, filled
on the device) give the same tokens as one round at a time with explicit inputs — and so do rounds of several decode
steps (StepPlan.steps: CUDA-graph replays fed on the device), launched overlapped the same way."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 24


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    from model.model import Glm5Model
    from tests.gpu.test_cuda_parity import write_wide_tiny
    ckpt = write_wide_tiny(tmp_path_factory.mktemp("overlap") / "wide", seed=5, embed_gain=16.0)
    return Glm5Model.load(ckpt, dtype=torch.bfloat16, device="cuda", progress=False)


def _plan(rnd: int, seqs: list[tuple[list[int], int, int, list[int]]], temperature: float, steps: int = 0):
    """One plan: per sequence (token ids, start, slot, block table); every sequence samples its last row."""
    from services.common.plan_checksum import seal
    from services.common.tensors import to_proto
    from twinspark.v1 import rank_pb2
    rows, at = [], 0
    for toks, *_ in seqs:
        at += len(toks)
        rows.append(at - 1)
    n = len(seqs)
    return seal(rank_pb2.StepPlan(
        round=rnd, token_ids=to_proto([t for toks, *_ in seqs for t in toks]),
        starts=to_proto([s for _, s, _, _ in seqs]), lengths=to_proto([len(t) for t, *_ in seqs]),
        slots=to_proto([sl for _, _, sl, _ in seqs]),
        block_tables=to_proto(torch.tensor([tb for *_, tb in seqs], dtype=torch.int32)),
        sample_rows=to_proto(rows), temperature=to_proto([temperature] * n, "float32"),
        top_p=to_proto([0.9] * n, "float32"), top_k=to_proto([50] * n), min_p=to_proto([0.0] * n, "float32"),
        seed=to_proto([11 + i for i in range(n)], "int64"), request_ids=[f"r{i}" for i in range(n)], steps=steps))


def _decode(model, pipelined: bool, temperature: float, steps: int = 1) -> list[list[int]]:
    from services.rank_worker.executor import Executor
    from services.rank_worker.plan_checks import PENDING_TOKEN
    ex = Executor(model, model.new_cache(num_blocks=64, block_size=16, num_slots=4))
    prompts = [list(range(5, 45)), list(range(100, 117))]
    tables = [list(range(0, 16)), list(range(16, 32))]
    first = ex.execute(_plan(1, [(p, 0, s, tables[s]) for s, p in enumerate(prompts)], temperature)).sampled
    out = [[t] for t in first]
    pos = [len(p) for p in prompts]
    rnd, running = 2, None

    def add(sampled: list[int]) -> None:  # row after row: each sequence's `steps` samples together
        for s in range(2):
            out[s] += sampled[s * steps : (s + 1) * steps]

    for _ in range(STEPS // steps):
        toks = [[PENDING_TOKEN] if pipelined else [out[s][-1]] for s in range(2)]
        plan = _plan(rnd, [(toks[s], pos[s], s, tables[s]) for s in range(2)], temperature, steps)
        rnd += 1
        if pipelined:
            # A decode round's launch must not wait for the GPU (the first one captures the CUDA graph: it may).
            torch.cuda.set_sync_debug_mode("error" if running is not None else "default")
            try:
                launched = ex.launch(plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert launched.overlappable
            if running is not None:  # round n read back after round n+1 was queued
                add(ex.finish(running).sampled)
            running = launched
        else:
            add(ex.execute(plan).sampled)
        pos = [p + steps for p in pos]
    if running is not None:
        add(ex.finish(running).sampled)
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overlapped_rounds_equal_one_at_a_time(wide_model, temperature):
    one_by_one = _decode(wide_model, False, temperature)
    overlapped = _decode(wide_model, True, temperature)
    print(f"T={temperature}: {[len(t) for t in overlapped]} tokens per sequence, identical: "
          f"{overlapped == one_by_one}")
    assert overlapped == one_by_one
    four_steps = _decode(wide_model, True, temperature, steps=4)
    print(f"T={temperature}: rounds of 4 decode steps identical: {four_steps == one_by_one}")
    assert four_steps == one_by_one
