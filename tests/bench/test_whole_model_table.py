"""bench/whole_model.py's collectives column: the rank profiler's trace of the stack's rounds read through
bench/chrome_trace.py, and the table cell it gives (a hand-made trace: no GPU here)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.whole_model import markdown, profiled_collectives


def _trace(path: Path) -> None:
    def x(name: str, ts: float, dur: float, corr: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}
    path.write_text(json.dumps({"traceEvents": [
        x("_exchange_kernel", 0, 30, 1), x("_gemm_kernel", 30, 160, 1), x("_exchange_kernel", 190, 10, 1)]}))


def test_profiled_collectives_reads_this_stacks_trace(tmp_path: Path) -> None:
    trace = tmp_path / "rank0-rounds.json"
    _trace(trace)
    c = profiled_collectives(trace, since=time.time() - 5, wait_s=1)
    assert c is not None and c["share"] == 40 / 200 and c["transfer_share"] == 20 / 200 and c["skew_ms"] == 0.02
    # a trace older than the stack is an earlier run's: not this one's figure
    assert profiled_collectives(trace, since=time.time() + 60, wait_s=0.2) is None


def test_table_has_the_collectives_cell() -> None:
    level = {"concurrency": 1, "output_throughput": 100.0, "itl": {"median_ms": 5.0, "p99_ms": 6.0},
             "decode_tok_s_per_request": 200.0, "ttft": {"median_ms": 50}, "warmup_s": 1.0}
    row = {"format": "w4a16+fp8", "ready_s": 40.0, "levels": [level], "gpu_memory": [],
           "exact": {"burst_same": 12, "staggered_same": 12, "n": 12},
           "collectives": {"share": 0.094, "transfer_share": 0.024}}
    data = {"date": "now", "model": "m", "config": {}, "tp": 2, "prompt_len": 128, "output_len": 128,
            "formats": [row, {**row, "collectives": None}]}
    md = markdown(data)
    assert "collectives, share of GPU busy (profiled rounds) |" in md
    assert "| 12/12 / 12/12 | 9.4% (transfer 2.4%) |" in md and "| 12/12 / 12/12 | — |" in md


def test_memory_table_reads_rank_zeros_log(tmp_path: Path) -> None:
    from bench.whole_model import memory_of
    log = tmp_path / "rank0.log"
    log.write_text("x INFO weights by part (MiB): routed experts 113468.2, KDA attention 2048.5; total 115516.7\n"
                   "x INFO kv pool budget 8000000000 bytes: 40960 per block of 64 positions (640 per position), "
                   "1000 per KDA slot -> 180000 blocks\n"
                   "x INFO kv pool: 180000 blocks x 64 positions, 32 slots: max_model_len 1048576\n"
                   "x INFO kv cache fp8: 40960 bytes per block (81920 as bfloat16)\n")
    mem = memory_of(log)
    assert mem["weights_mib"] == {"routed experts": 113468.2, "KDA attention": 2048.5, "total": 115516.7}
    assert mem["pool_tokens"] == 180000 * 64 and mem["pool_mib"] == round(40960 * 180000 / 2**20, 1)
    row = {"format": "int3+fp8", "ready_s": 1.0, "memory": mem}
    md = markdown({"date": "now", "model": "m", "config": {}, "tp": 1, "prompt_len": 1, "output_len": 1,
                   "formats": [row]})
    assert "| routed experts | 113468.2 |" in md and "| weights, total | 115516.7 |" in md
    assert "| KV pool (tokens) | 7031.2 (11,520,000 fp8) |" in md
    assert memory_of(tmp_path / "absent.log") == {"weights_mib": None}
