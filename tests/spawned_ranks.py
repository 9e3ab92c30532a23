"""Run a function as `world` spawned rank processes joined on one loopback port, and collect what each reported.

`target(rank, world, port, results)` must put exactly one ("ok", value) or ("error", message) on `results`, also when
it fails (catch, format the traceback, put it): the parent waits for one report per rank."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable

from services.rank_worker.distributed import free_port


def run_ranks(world: int, target: Callable, *, timeout_s: float = 240) -> list:
    """Every rank's reported value, in the order they came; fails the test with every rank's error."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=timeout_s) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [str(value) for status, value in got if status != "ok"]
    assert not errors, "\n".join(errors)
    return [value for _, value in got]
