"""Offline generation on one machine: prefill in chunks, then decode with keyed sampling.

Used by `twinspark generate` and by tests as the straightforward reference path that the serving stack must match
token for token. With TP > 1 every rank runs this same loop on its shard (all ranks hold identical logits, so they
sample identical tokens); rank 0 reports the result.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from kernels.sampling import SamplingParams, sample
from services.rank_worker.distributed import free_port, join_group, rank_device
from model.batch import Batch
from model.model import Glm5Model


@dataclass(frozen=True)
class GenerateRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    prefill_chunk: int = 256


def generate_on_model(model: Glm5Model, req: GenerateRequest, *, block_size: int = 16,
                      kv_dtype: torch.dtype | None = None) -> list[int]:
    """Generate for one request on an already loaded (shard of the) model; kv_dtype: see `Glm5Model.new_cache`."""
    if not req.prompt_ids:
        raise ValueError("the prompt is empty")
    total = len(req.prompt_ids) + req.max_tokens
    n_blocks = -(-total // block_size)
    cache = model.new_cache(num_blocks=n_blocks, block_size=block_size, num_slots=1, kv_dtype=kv_dtype)
    table = list(range(n_blocks))
    params = SamplingParams.from_lists([req.temperature], [req.top_k], [req.top_p], [req.min_p], [req.seed],
                                       device=model.device)
    eos = set() if req.ignore_eos else set(model.cfg.eos_token_id)
    ids = list(req.prompt_ids)
    pos = 0
    out: list[int] = []
    while len(out) < req.max_tokens:
        chunk = ids[pos : pos + req.prefill_chunk] if pos < len(req.prompt_ids) else ids[pos:]
        result = model.forward(Batch.single(chunk, pos, table, device=model.device), cache)
        pos += len(chunk)
        if pos < len(ids):
            continue  # more prompt to prefill
        token = int(sample(result.logits, torch.tensor([pos], device=model.device), params)[0])
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


@torch.inference_mode()
def prompt_log_softmax(model: Glm5Model, prompt_ids: list[int], *, prefill_chunk: int = 256,
                       block_size: int = 16) -> torch.Tensor:
    """The reference of prompt logprobs: torch.log_softmax of the model's fp32 logits at every prompt row but the
    last, [len(prompt) - 1, vocab] (row i is the distribution of prompt token i + 1). Prefilled in chunks of
    `prefill_chunk` (a multiple of 64, as the scheduler cuts prompts), each chunk's logits taken whole."""
    if len(prompt_ids) < 2:
        raise ValueError("a prompt of at least 2 tokens has a token to score")
    n_blocks = -(-len(prompt_ids) // block_size)
    cache = model.new_cache(num_blocks=n_blocks, block_size=block_size, num_slots=1)
    table = list(range(n_blocks))
    rows = []
    for pos in range(0, len(prompt_ids), prefill_chunk):
        chunk = list(prompt_ids[pos : pos + prefill_chunk])
        batch = Batch.single(chunk, pos, table, all_logits=True, device=model.device)
        batch.prompt = [True]  # prompt arithmetic, even for a one-row last chunk (as the scheduler flags it)
        rows.append(torch.log_softmax(model.forward(batch, cache).logits.float(), dim=-1).cpu())
    return torch.cat(rows)[:-1]


def _rank_main(rank: int, world: int, port: int, model_dir: str, device: str, dtype: torch.dtype,
               job: Callable[[Glm5Model], Any], results: "mp.Queue", collective: str) -> None:
    try:
        if device == "cpu":  # ranks share the machine's cores; oversubscribed OpenMP threads spin against each other
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        sharding, group, exchange = join_group(rank, world, master_addr="127.0.0.1", master_port=port,
                                               device=device, collective=collective)
        model = Glm5Model.load(model_dir, sharding=sharding, group=group, exchange=exchange, dtype=dtype,
                               device=rank_device(device, rank), progress=rank == 0)
        value = job(model)
        if rank == 0:
            # Plain pickle copies tensor data into the message; multiprocessing's own pickler would pass a
            # shared-memory handle that dies with this process before the parent reads it.
            results.put(("ok", pickle.dumps(value)))
    except BaseException as exc:  # report, never leave the parent waiting
        results.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def run_on_ranks(model_dir: str | Path, job: Callable[[Glm5Model], Any], *, tp: int = 1, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, timeout_s: float = 600.0, collective: str = "auto") -> Any:
    """Run `job(model)` on every rank of a TP group (spawned processes for TP > 1, exchanging through
    `collective`, serve-rank's --collective); return rank 0's result.

    `job` must be picklable (a module-level function or a functools.partial of one).
    """
    if tp == 1:
        return job(Glm5Model.load(model_dir, dtype=dtype, device=rank_device(device, 0)))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, str(model_dir), device, dtype, job, results,
                                                        collective))
             for r in range(tp)]
    for p in procs:
        p.start()
    try:
        status, value = results.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return pickle.loads(value)


def generate(model_dir: str | Path, req: GenerateRequest, *, tp: int = 1, device: str = "cpu",
             dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None) -> list[int]:
    """Generate with TP ranks (see `run_on_ranks`)."""
    return run_on_ranks(model_dir, partial(generate_on_model, req=req, kv_dtype=kv_dtype), tp=tp, device=device,
                        dtype=dtype)
