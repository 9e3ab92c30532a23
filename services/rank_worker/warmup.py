"""Warm-up before serving: the rank runs the kinds of rounds serving meets first, so that on a GPU the kernels they
need compile (and fla-core's autotune) before the rank serves, not on a user's request.

Without it, the first long prompt after the stack said ready took about two minutes, nearly all of it compiles, and
a round of decode rows beside a prompt chunk, first met mid-stream, stalled a stream for seconds (docs/gpu-engine.md,
"Warm-up before serving"). vLLM and SGLang compile and tune before serving too.

The rounds, as the scheduler would plan them at the step budget B (a multiple of the 64-token grid):
1. a prompt chunk of B rows at position 0 (greedy, with logprobs);
2. that prompt's tail: an odd number of rows after it (seeded sampling with top-k / top-p / min-p);
3. a decode row of that sequence beside a second prompt's first chunk of B - 64 rows (the mixed round);
4. a decode round of both under a grammar mask, and a verify window (drafts) of the first;
5. a short prompt alone, whose rows take every pool they see (the DSA selection's other kernel build).
They go through `Executor.execute` as served plans do, so sampling, logprobs, masks and the CUDA graphs' replays run as
well. They leave nothing behind: nothing is served before they end, the scheduler hands out every slot and block as
fresh (a sequence starting at position 0 begins from a zero KDA state, and a block is written before it is read),
and the executor's per-slot facts are cleared. Every rank runs the same rounds in the same order, so the
collectives pair up.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from services.common.tensors import to_proto
from model.model import Glm5Model
from services.rank_worker.executor import Executor
from twinspark.v1 import rank_pb2

log = logging.getLogger("twinspark.rank")

GRID = 64  # prompts are cut on the KDA chunk grid (docs/design.md §5.5)
TAIL = 37  # rows of a prompt's last chunk: off the 16-row grid, as most tails are


def warm_budget(budget: int, num_blocks: int, block_size: int, max_positions: int) -> int:
    """The prompt chunk the warm-up runs: the step budget on the grid, smaller where the pool or the window cannot
    hold two such prompts (0: too small to warm up)."""
    room = min(num_blocks * block_size, max_positions) // 2 - TAIL - 8
    return max(0, min(budget, room) // GRID * GRID)


def _plan(seqs: list[tuple[list[int], int, int, list[int], bool]], sample_rows: list[int], *, temperature: float,
          logprobs_k: int = -1, verify: list[bool] | None = None, mask_vocab: int = 0) -> rank_pb2.StepPlan:
    """A plan of (token ids, start, slot, blocks, is prompt) sequences sampling `sample_rows` alike."""
    width = max(len(s[3]) for s in seqs)
    r = len(sample_rows)
    plan = rank_pb2.StepPlan(
        token_ids=to_proto([t for s in seqs for t in s[0]]), starts=to_proto([s[1] for s in seqs]),
        lengths=to_proto([len(s[0]) for s in seqs]), slots=to_proto([s[2] for s in seqs]),
        block_tables=to_proto(torch.tensor([s[3] + [0] * (width - len(s[3])) for s in seqs], dtype=torch.int32)),
        sample_rows=to_proto(sample_rows), temperature=to_proto([temperature] * r, "float32"),
        top_p=to_proto([0.9] * r, "float32"), top_k=to_proto([50] * r), min_p=to_proto([0.05] * r, "float32"),
        seed=to_proto([1234 + i for i in range(r)], "int64"), prompt=to_proto([int(s[4]) for s in seqs]),
        logprobs_k=to_proto([logprobs_k] * r))
    if verify is not None:
        plan.verify.CopyFrom(to_proto([int(v) for v in verify]))
    if mask_vocab:  # one mask row (every other id allowed) for the first sample row
        words = -(-mask_vocab // 32)
        plan.mask_index.CopyFrom(to_proto([0] + [-1] * (r - 1)))
        plan.bitmask.CopyFrom(to_proto(torch.full((1, words), 0x55555555, dtype=torch.int32)))
    return plan


def _ids(n: int, vocab: int) -> list[int]:
    v = min(vocab, 1000)
    return [1 + (7 * i) % (v - 1) for i in range(n)]


def activation_peak(model: Glm5Model, budget: int, *, block_size: int, kv_dtype: torch.dtype | None) -> int:
    """Bytes of GPU memory one prompt chunk at the step budget takes beyond the weights: vLLM's profile run. The
    pool is sized after it, so the largest round serving meets still fits beside a pool filled to the memory
    budget (without it, 45 layers on one H200 filled the memory with blocks and the first 8,192-token chunk ran out
    of memory). One chunk of `budget` rows on the grid through a throwaway two-slot cache, eager; every rank of a
    group runs it alike, so the collectives pair up."""
    chunk = min(budget, model.cfg.max_position_embeddings - GRID) // GRID * GRID
    if chunk < GRID:
        return 0
    blocks = -(-chunk // block_size) + 1
    cache = model.new_cache(num_blocks=blocks, block_size=block_size, num_slots=2, kv_dtype=kv_dtype)
    executor = Executor(model, cache, cuda_graphs=False)
    torch.cuda.synchronize(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    base = torch.cuda.memory_allocated(model.device)
    executor.execute(_plan([(_ids(chunk, model.cfg.vocab_size), 0, 0, list(range(blocks)), True)], [chunk - 1],
                           temperature=0.0, logprobs_k=1))
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - base
    del executor, cache
    gc.collect()
    torch.cuda.empty_cache()
    log.info("profile run: a %d-row prompt chunk takes %.2f GiB beyond the weights", chunk, peak / 2**30)
    return peak


def warm_up(executor: Executor, budget: int) -> float:
    """Run the warm-up rounds at chunks of `budget` rows (see the module note); returns the seconds they took."""
    cache, cfg = executor.cache, executor.model.cfg
    chunk = warm_budget(budget, cache.num_blocks, cache.block_size, cfg.max_position_embeddings)
    if chunk < GRID or cache.num_slots < 2:
        log.info("warm-up skipped: the pool holds too little for a %d-token round", budget)
        return 0.0
    t0 = time.perf_counter()
    bs = cache.block_size
    ids = _ids(chunk + TAIL + 4, cfg.vocab_size)
    a_len = chunk + TAIL
    a_blocks = list(range(-(-(a_len + 4) // bs)))
    b_blocks = list(range(len(a_blocks), len(a_blocks) + -(-chunk // bs)))
    b_len = chunk - GRID
    rounds = [
        _plan([(ids[:chunk], 0, 0, a_blocks, True)], [chunk - 1], temperature=0.0, logprobs_k=1),
        _plan([(ids[chunk:a_len], chunk, 0, a_blocks, True)], [TAIL - 1], temperature=1.0),
        _plan([([ids[a_len]], a_len, 0, a_blocks, False), (ids[:b_len], 0, 1, b_blocks, True)], [0, b_len],
              temperature=0.0),
        _plan([([ids[a_len + 1]], a_len + 1, 0, a_blocks, False), ([ids[b_len]], b_len, 1, b_blocks, False)],
              [0, 1], temperature=0.0, logprobs_k=2, mask_vocab=cfg.vocab_size),
        _plan([(ids[a_len + 2:a_len + 4], a_len + 2, 0, a_blocks, False)], [0, 1], temperature=0.0,
              verify=[True]),
        # a short prompt alone: its rows see no more pools than the DSA selection keeps, so it takes them all (the
        # selection's other build; the rounds above see more pools than that wherever the budget's chunk does)
        _plan([(ids[:TAIL], 0, 1, b_blocks, True)], [TAIL - 1], temperature=0.0),
    ]
    for plan in rounds:
        executor.execute(plan)
    if executor.model.device.type == "cuda":
        torch.cuda.synchronize()
    executor.forget_slots()
    took = time.perf_counter() - t0
    log.info("warm-up: %d rounds (prompt chunks of %d and %d rows, a %d-row tail, decode rows, a verify window, a "
             "%d-row prompt) in %.1f s", len(rounds), chunk, b_len, TAIL, TAIL, took)
    return took
