"""Served-path bench in vLLM `bench serve`'s terms against `twinspark up`: TTFT, TPOT, ITL, E2E latency (mean,
median, p99), output and total token throughput and request throughput, at several concurrency levels.

Each level sends `--requests` completions of random-token prompts (`--prompt-len` ids, seeded) with a fixed output
length (`ignore_eos`), streamed, at most `--concurrency` at a time; token times are the arrival times of the SSE
chunks. Each level is measured after an untimed pass of its own (`--no-warmup`: from cold). Greedy by default
(docs/reference.md §5: quote the prompt class and temperature with every tok/s; random-token prompts, so drafts are off unless
asked for). The stack is a running one (`--state-dir`) or one started here.

    python -m bench.serve --concurrency 1,4,16,64 --out bench/results                 # CPU, tiny, TP 2
    python -m bench.serve --state-dir ~/.local/state/twinspark --concurrency 1,4,16,64  # a running GPU stack

Writes serve-<time>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.stack import add_stack_args, attach_or_start, load_line, machine_load, write_results


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    e2e_s: float = 0.0
    out_tokens: int = 0
    error: str = ""


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


async def one(client: httpx.AsyncClient, body: dict) -> Sample:
    """One streamed completion. Tokens are counted from the chunks' `token_ids` (the body asks for them: a random-
    weight model over a small tokenizer emits many ids that decode to no text), else one per chunk with text."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", "/completions", json={**body, "return_token_ids": True}) as r:
            if r.status_code != 200:
                return Sample(False, error=f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                if n:
                    stamps.append(time.perf_counter())
                    tokens += n
    except httpx.HTTPError as exc:
        return Sample(False, error=type(exc).__name__)
    if not stamps:
        return Sample(False, error="no tokens")
    return Sample(True, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], stamps[-1] - t0, tokens)


async def level(url: str, bodies: list[dict], concurrency: int) -> tuple[list[Sample], float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        async def gated(b: dict) -> Sample:
            async with sem:
                return await one(client, b)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(gated(b) for b in bodies))
        return list(out), time.perf_counter() - t0


def warm_up(url: str, bodies: list[dict], concurrency: int) -> float:
    """An untimed pass at `concurrency` (vLLM `bench serve`'s warm-ups), with prompts unlike the measured ones (no
    prefix-cache hits): the level's first kernel compiles and lazy CUDA-graph captures (one per batch bucket and
    block-table width) land here, not in its figures. Returns its wall seconds, which the results keep: a long one
    is what a cold server costs its first users."""
    rng = random.Random(-concurrency)
    fresh = [{**b, "prompt": [rng.randrange(5, 1000) for _ in b["prompt"]]} for b in bodies[:concurrency]]
    t0 = time.perf_counter()
    asyncio.run(level(url, fresh, concurrency))
    return time.perf_counter() - t0


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return {"mean_ms": statistics.fmean(s) * 1e3, "median_ms": statistics.median(s) * 1e3,
            "p99_ms": s[min(len(s) - 1, int(0.99 * (len(s) - 1) + 0.5))] * 1e3}


def summarize(samples: list[Sample], wall_s: float, prompt_len: int) -> dict:
    ok = [s for s in samples if s.ok]
    out_tokens = sum(s.out_tokens for s in ok)
    tpot = [(s.e2e_s - s.ttft_s) / (s.out_tokens - 1) for s in ok if s.out_tokens > 1]
    return {"requests": len(samples), "completed": len(ok), "errors": sorted({s.error for s in samples if not s.ok}),
            "duration_s": wall_s, "request_throughput": len(ok) / wall_s,
            "output_throughput": out_tokens / wall_s, "total_token_throughput": (out_tokens + prompt_len * len(ok))
            / wall_s, "ttft": _stats([s.ttft_s for s in ok]), "tpot": _stats(tpot),
            "itl": _stats([g for s in ok for g in s.itl_s]), "e2e": _stats([s.e2e_s for s in ok])}


def markdown(data: dict) -> str:
    a = data["args"]
    lines = [f"# serve — {data['date']}", "",
             f"- stack: {data['stack']}; completions, prompts of {a['prompt_len']} random token ids (seed "
             f"{a['seed']}), {a['output_len']} output tokens (ignore_eos), temperature {a['temperature']}, "
             f"streamed; drafts {'on' if a['drafts'] else 'off'}; "
             f"{'each level after an untimed pass of its own' if a.get('warmup', True) else 'cold (no warm-up)'}",
             f"- {data['load']}", "",
             "| concurrency | requests | ok | req/s | output tok/s | total tok/s | TTFT mean / median / p99 ms | "
             "TPOT mean / median / p99 ms | ITL mean / median / p99 ms | E2E median ms |",
             "|---:|---:|---:|---:|---:|---:|---|---|---|---:|"]

    def three(d: dict) -> str:
        return f"{d['mean_ms']:.1f} / {d['median_ms']:.1f} / {d['p99_ms']:.1f}" if d else "-"
    for r in data["levels"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['completed']} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} | {three(r['ttft'])} | "
                     f"{three(r['tpot'])} | {three(r['itl'])} | "
                     f"{r['e2e']['median_ms']:.0f} |" if r["e2e"] else f"| {r['concurrency']} | failed |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_args(ap)
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64], help="levels (default 1,4,16,64)")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: 4 x the level, at least 8)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt token ids per request (default 128)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--drafts", action="store_true", help="let the drafter propose (default: \"draft\": false)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="measure from cold: no untimed pass of each level first")
    ap.add_argument("--out", type=Path, default=None, help="folder for serve-<time>.json/.md (default: print only)")
    args = ap.parse_args(argv)
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model)
    try:
        model = httpx.get(stack.url + "/v1/models", timeout=30).json()["data"][0]
        vocab = 1000  # ids inside any checkpoint's vocabulary
        rng = random.Random(args.seed)
        before = machine_load()
        levels = []
        for c in args.concurrency:
            n = args.requests or max(8, 4 * c)
            bodies = [{"model": model["id"], "prompt": [rng.randrange(5, vocab) for _ in range(args.prompt_len)],
                       "max_tokens": args.output_len, "ignore_eos": True, "temperature": args.temperature,
                       "stream": True, "draft": args.drafts} for _ in range(n)]
            warm = warm_up(stack.url + "/v1", bodies, c) if args.warmup else 0.0
            samples, wall = asyncio.run(level(stack.url + "/v1", bodies, c))
            row = {"concurrency": c, **summarize(samples, wall, args.prompt_len), "warmup_s": warm}
            levels.append(row)
            print(f"concurrency {c}: {row['completed']}/{row['requests']} ok, {row['output_throughput']:.1f} "
                  f"output tok/s, TTFT median {row['ttft'].get('median_ms', float('nan')):.1f} ms, ITL median "
                  f"{row['itl'].get('median_ms', float('nan')):.1f} ms", flush=True)
        data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                      for k, v in vars(args).items()},
                "stack": f"{model['id']} (max_model_len {model.get('max_model_len', '?')}), "
                         f"{'running at ' + args.state_dir if args.state_dir else f'started here, TP {args.tp}'}",
                "load": load_line(before, machine_load()), "levels": levels}
        md = markdown(data)
        print(md)
        write_results(args.out, "serve", data, md)
    finally:
        stack.down()
    return 0 if all(r["completed"] == r["requests"] for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
