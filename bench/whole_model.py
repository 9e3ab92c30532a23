"""The whole GLM-5.3-Flash (45 layers + the MTP layer, real dimensions) as a served stack on random quantized
weights: `twinspark up --device cuda --tp N --model DIR --random-weights FORMAT` per format, then through HTTP the
batch-1 decode rate (streamed, greedy, random-token prompts, drafts off), a small concurrency sweep, GPU memory per
device once warm, and the 12-request burst / staggered = serial check (bench/concurrency_check.py).

DIR holds what a checkpoint holds but its weights: the release's text config (docs/reference.md §1: 45 layers 3:1 KDA / MLA,
layers 0-2 dense, 288 experts, vocabulary 154,880, one MTP layer) with make-tiny's tokenizer and chat template (the
release's tokenizer is not on this machine; the ids it produces all fall inside the vocabulary). `--write-dir`
writes it and stops, so it can be made on a CPU machine.

    python -m bench.whole_model --write-dir /tmp/glm53-config
    python -m bench.whole_model --model /tmp/glm53-config --tp 2 --formats w4a16+bf16 --out bench/results

Writes whole_model-<time>.json and .md under --out. With the rank profiler on (TWINSPARK_TORCH_PROFILER_DIR,
TWINSPARK_PROFILE_ROUNDS=SKIP:COUNT inside a timed level) at TP > 1, a column gives the collectives' share of rank
0's GPU busy time over the profiled rounds, and of it the transfer (bench/chrome_trace.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import flags
from bench.chrome_trace import trace_collectives
from bench.concurrency_check import check
from bench.output import stamp, write_results
from bench.served_load import completion_bodies, level, summarize, warm_up
from bench.stack import attach_or_start, round_stats
from model import memory_parts
from services.common import shared_flags as shared

LAYERS = 45
DENSE_LAYERS = 3
# Seconds per round-stats line of the ranks (serve-rank --stats-interval): several lines per timed level.
STATS_INTERVAL_S = 2.0


def write_model_dir(out: Path, *, layers: int = LAYERS) -> Path:
    """The release's config (+ one MTP layer) with make-tiny's tokenizer, no weights."""
    from model.checkpoint import write_model_files
    from model.checkpoint.spec import TinySpec
    from model.checkpoint.tokenizer_builder import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    spec = TinySpec(num_hidden_layers=layers, dense_layers=DENSE_LAYERS, num_nextn_predict_layers=1)  # the release
    write_model_files(out, spec, build_tokenizer(), dtype="bfloat16")
    return out


def gpu_memory_mib() -> list[dict]:
    """Used / total MiB per GPU (nvidia-smi: the ranks are other processes)."""
    q = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, check=True).stdout
    return [{"gpu": int(i), "used_mib": int(u), "total_mib": int(t)}
            for i, u, t in (line.split(", ") for line in q.strip().splitlines())]


def running_limits(concurrency: int) -> dict[str, str]:
    """What a user serving `concurrency` streams at once sets beyond the defaults (16 running requests, 32 KDA
    slots: the rest hold prefix snapshots): room for every stream to run, and as many snapshot slots as by default.
    Without it the 32-stream level ran 16 at a time and half its requests waited for a whole reply."""
    from services.rank_worker.settings import RankSettings
    from services.scheduler.cli import SchedulerSettings
    running, slots = SchedulerSettings.max_num_seqs, RankSettings.num_slots
    if concurrency <= running:
        return {}
    return {"TWINSPARK_MAX_NUM_SEQS": str(concurrency), "TWINSPARK_NUM_SLOTS": str(concurrency + slots - running)}


def run_format(fmt: str, args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """One format's stack, levels and exactness check; `save(row)` after each level and at the end, so a run cut
    short (a call's time limit) keeps what it measured."""
    env = {"TWINSPARK_DEVICE": "cuda", "TWINSPARK_RANDOM_WEIGHTS": fmt, "TWINSPARK_DRAFTER": "none",
           "TWINSPARK_STATS_INTERVAL": str(STATS_INTERVAL_S), **running_limits(max(args.concurrency)),
           **({"TWINSPARK_NUM_BLOCKS": str(args.num_blocks)} if args.num_blocks else {})}
    t0, started = time.perf_counter(), time.time()
    stack = attach_or_start(None, tp=args.tp, model=str(args.model), env=env)
    row: dict = {"format": fmt, "ready_s": round(time.perf_counter() - t0, 1)}
    print(f"{fmt}: stack ready in {row['ready_s']} s", flush=True)
    row["memory"] = memory_of(stack.state_dir / "logs" / "rank0.log")
    print(f"{fmt}: rank 0's memory {row['memory']}", flush=True)
    try:
        url = stack.url + "/v1"
        levels = []
        for c in args.concurrency:
            bodies = completion_bodies([args.prompt_len] * max(2, c), args.output_len, random.Random(c), draft=False)
            warm = warm_up(url, bodies, c)
            log = stack.state_dir / "logs" / "rank0.log"
            seen = log.stat().st_size
            samples, wall = asyncio.run(level(url, bodies, c))
            s = summarize(samples, wall, args.prompt_len)
            s["concurrency"] = c
            s["warmup_s"] = warm
            s["decode_tok_s_per_request"] = 1e3 / s["itl"]["median_ms"] if s["itl"] else 0.0
            s["rank_stats"] = round_stats(log, seen)
            levels.append(s)
            row["levels"] = levels
            save(row)
            print(f"{fmt} concurrency {c}: {s['completed']}/{s['requests']} ok, output {s['output_throughput']:.1f} "
                  f"tok/s, ITL median {s['itl'].get('median_ms', float('nan')):.2f} ms "
                  f"({s['decode_tok_s_per_request']:.1f} tok/s per request), TTFT median "
                  f"{s['ttft'].get('median_ms', float('nan')):.0f} ms", flush=True)
        row["prefill"] = [served_prefill(url, n) for n in args.prefill]
        row["gpu_memory"] = gpu_memory_mib()
        print(f"{fmt}: GPU memory {row['gpu_memory']}", flush=True)
        exact = check(url)
        row["exact"] = {"staggered_same": exact.staggered_same, "burst_same": exact.burst_same,
                        "n": len(exact.serial)}
        print(exact.line(fmt), flush=True)
        profiles = os.environ.get("TWINSPARK_TORCH_PROFILER_DIR")
        if profiles and args.tp > 1:
            row["collectives"] = profiled_collectives(Path(profiles) / "rank0-rounds.json", started)
            print(f"{fmt}: collectives in rank 0's profiled rounds: {row['collectives']}", flush=True)
    except Exception as exc:  # a failed format is recorded and the next one still runs
        row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{fmt}: {row['error']}", flush=True)
    finally:
        stack.down()
    save(row)
    return row


def served_prefill(url: str, tokens: int, tries: int = 2) -> dict:
    """One prompt of `tokens` random ids and one token out, alone on the stack, after an untimed prompt of the same
    length (its compiles): the time to the first token and the prompt tokens per second it implies (the best of
    `tries`; HTTP, tokenization-free ids and the scheduler's chunking at the step budget included)."""
    bodies = completion_bodies([tokens], 1, random.Random(tokens), draft=False)
    warm_up(url, bodies, 1)
    ttfts = []
    for i in range(tries):
        fresh = completion_bodies([tokens], 1, random.Random(tokens + 1 + i), draft=False)
        samples, _ = asyncio.run(level(url, fresh, 1))
        if samples[0].ok:
            ttfts.append(samples[0].ttft_s)
    out = {"tokens": tokens, "ttft_s": min(ttfts) if ttfts else None}
    out["tok_s"] = tokens / out["ttft_s"] if out["ttft_s"] else None
    print(f"prefill of {tokens} tokens: TTFT {out['ttft_s']} s ({out['tok_s']} tok/s)", flush=True)
    return out


def memory_of(log: Path) -> dict:
    """Rank 0's weights by part (MiB, model/memory_parts.py's log line) and its KV pool (blocks, positions, bytes,
    kv cache dtype) from its start-up log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    out: dict = {"weights_mib": memory_parts.parse(text)}
    pool = re.findall(r"kv pool: (\d+) blocks x (\d+) positions, (\d+) slots", text)
    budget = re.findall(r"kv pool budget (\d+) bytes: (\d+) per block", text)
    dtype = re.findall(r"kv cache (\w+): \d+ bytes per block", text)
    if pool:
        blocks, positions, slots = map(int, pool[-1])
        out.update(pool_blocks=blocks, pool_tokens=blocks * positions, pool_slots=slots)
    if budget:
        out["pool_mib"] = round(int(budget[-1][1]) * out.get("pool_blocks", 0) / 2**20, 1)
    if dtype:
        out["kv_cache_dtype"] = dtype[-1]
    return out


def memory_markdown(data: dict) -> list[str]:
    """A table per format of rank 0's memory: each part's weights, then the KV pool (with its token count)."""
    rows = [(r["format"], r["memory"]) for r in data["formats"] if (r.get("memory") or {}).get("weights_mib")]
    if not rows:
        return []
    lines = ["", "Rank 0's memory per part (MiB; weights as held on the GPU, the KV pool as sized at start):", "",
             "| part | " + " | ".join(f for f, _ in rows) + " |", "|---|" + "---:|" * len(rows)]
    parts = list(dict.fromkeys(p for _, m in rows for p in m["weights_mib"] if p != "total"))
    for p in [*parts, "total"]:
        lines.append(f"| {'weights, total' if p == 'total' else p} | "
                     + " | ".join(f"{m['weights_mib'].get(p, 0):.1f}" for _, m in rows) + " |")
    lines.append("| KV pool (tokens) | " + " | ".join(
        f"{m.get('pool_mib', 0):.1f} ({m.get('pool_tokens', 0):,} {m.get('kv_cache_dtype', '')})" for _, m in rows)
        + " |")
    return lines


def profiled_collectives(trace: Path, since: float, wait_s: float = 60.0) -> dict | None:
    """The collective figures (bench/chrome_trace.py) of the rank profiler's trace of this stack's rounds (the rank
    writes it when its profiled window ends: waited for, up to wait_s); None when it never came or holds none."""
    until = time.time() + wait_s
    while time.time() < until:
        try:
            if trace.stat().st_mtime >= since:
                return trace_collectives(trace)
        except (OSError, ValueError):  # not there yet, or still being written
            pass
        time.sleep(1.0)
    return None


def _collective_cell(c: dict | None) -> str:
    return f"{c['share']:.1%} (transfer {c['transfer_share']:.1%})" if c else "—"


def markdown(data: dict) -> str:
    lines = [f"# whole model — {data['date']}", "",
             f"- {data['model']}: {data['config'].get('num_hidden_layers', '?')} layers + MTP at real dims, random "
             f"weights drawn on the GPUs, TP "
             f"{data['tp']}; served through `twinspark up --device cuda` (drafter off), completions of "
             f"{data['prompt_len']} random token ids, {data['output_len']} tokens out, greedy, streamed; each level "
             f"after an untimed pass of its own (compiles, graph captures: its wall time is the warm-up column)"
             + (f"; `--max-num-seqs {data['max_num_seqs']}`" if data.get("max_num_seqs") else ""), "",
             "| format (experts+rest) | ready s | concurrency | output tok/s | ITL median / p99 ms | decode tok/s "
             "per request | TTFT median ms | warm-up s | GPU memory used MiB | burst / staggered = serial | "
             "collectives, share of GPU busy (profiled rounds) |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|---|---:|"]
    for r in data["formats"]:
        if "levels" not in r:
            lines.append(f"| {r['format']} | {r['ready_s']} | failed: {r.get('error', '?')} | | | | | | | | |")
            continue
        mem = ", ".join(f"{g['used_mib']}/{g['total_mib']}" for g in r.get("gpu_memory", []))
        ex = r.get("exact")
        exact = f"{ex['burst_same']}/{ex['n']} / {ex['staggered_same']}/{ex['n']}" if ex else r.get("error", "-")
        for s in r["levels"]:
            itl = s["itl"]
            lines.append(f"| {r['format']} | {r['ready_s']} | {s['concurrency']} | {s['output_throughput']:.1f} | "
                         f"{itl.get('median_ms', 0):.2f} / {itl.get('p99_ms', 0):.2f} | "
                         f"{s['decode_tok_s_per_request']:.1f} | {s['ttft'].get('median_ms', 0):.0f} | "
                         f"{s.get('warmup_s', 0):.1f} | {mem} | "
                         f"{exact} | {_collective_cell(r.get('collectives'))} |")
    prefills = [(r["format"], p) for r in data["formats"] for p in r.get("prefill", []) if p.get("ttft_s")]
    if prefills:
        lines += ["", "One prompt alone, one token out (served; best of two after an untimed one of the same length):",
                  "", "| format | prompt tokens | TTFT s | prompt tok/s |", "|---|---:|---:|---:|"]
        lines += [f"| {f} | {p['tokens']:,} | {p['ttft_s']:.3f} | {p['tok_s']:,.0f} |" for f, p in prefills]
    lines += memory_markdown(data)
    stats = [(r["format"], s) for r in data["formats"] for s in r.get("levels", []) if s.get("rank_stats")]
    if stats:
        lines += ["", f"Rank 0's round stats during each timed level (a line per {STATS_INTERVAL_S:g} s window: "
                  "docs/deploy.md, \"Round stats\"):", ""]
        for fmt, s in stats:
            lines += [f"- {fmt}, concurrency {s['concurrency']}:", *(f"  - {x}" for x in s["rank_stats"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.whole_model", __doc__)
    ap.add_argument("--write-dir", type=Path, help="write the config + tokenizer directory here and stop")
    flags.add(ap, flags.LAYERS, f"text layers of the written config (default {LAYERS})", default=str(LAYERS))
    flags.add(ap, shared.MODEL, "a directory written by --write-dir (or any checkpoint's config)", type=Path)
    flags.add(ap, shared.TP, "ranks, one GPU each (default 2)", default="2")
    ap.add_argument("--formats", default="w4a16+bf16",
                    help="--random-weights recipes, comma-separated (default w4a16+bf16; on a GPU only the routed "
                         "experts stay packed so far, so a quantized rest is loaded dense)")
    flags.add(ap, flags.CONCURRENCY, "levels (default 1,8)", default="1,8")
    flags.add(ap, flags.PROMPT_LEN, default="128")
    flags.add(ap, flags.OUTPUT_LEN, default="128")
    ap.add_argument("--prefill", type=flags.ints, default=[],
                    help="prompt lengths timed alone after the levels, one token out (e.g. 8192): served TTFT and "
                         "prompt tok/s (default none)")
    flags.add(ap, shared.NUM_BLOCKS, "KV blocks per rank (default: serve-rank's)")
    flags.add(ap, flags.OUT, "folder for whole_model-<time>.json/.md (default: print only)")
    args = ap.parse_args(argv)
    if args.write_dir:
        print(f"wrote {write_model_dir(args.write_dir, layers=args.layers)}")
        return 0
    if not args.model:
        ap.error("--model DIR (or --write-dir DIR first)")
    rows: list[dict] = []
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": str(args.model), "tp": args.tp,
            "prompt_len": args.prompt_len, "output_len": args.output_len, "formats": rows,
            "max_num_seqs": int(running_limits(max(args.concurrency)).get("TWINSPARK_MAX_NUM_SEQS", 0)) or None,
            "config": json.loads((args.model / "config.json").read_text()).get("text_config", {})}
    at = stamp()

    def save(row: dict) -> None:
        so_far = {**data, "formats": [*rows, row]}
        write_results(args.out, "whole_model", so_far, markdown(so_far), at=at)

    for f in (f.strip() for f in args.formats.split(",")):
        if f:
            rows.append(run_format(f, args, save))
    md = markdown(data)
    print(md)
    write_results(args.out, "whole_model", data, md, at=at)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
