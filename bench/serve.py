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

import asyncio
import random
import sys
import time

import httpx

from bench import flags
from bench.output import args_record, write_results
from bench.served_load import completion_bodies, level, summarize, warm_up
from bench.stack import add_stack_args, attach_or_start, load_line, machine_load


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
    ap = flags.parser("bench.serve", __doc__)
    add_stack_args(ap)
    flags.add(ap, flags.CONCURRENCY, "levels (default 1,4,16,64)", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: 4 x the level, at least 8)")
    flags.add(ap, flags.PROMPT_LEN, "prompt token ids per request (default 128)", default="128")
    flags.add(ap, flags.OUTPUT_LEN, "output tokens per request (default 64)", default="64")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--drafts", action="store_true", help="let the drafter propose (default: \"draft\": false)")
    flags.add(ap, flags.SEED, "seed of the prompts")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="measure from cold: no untimed pass of each level first")
    flags.add(ap, flags.OUT, "folder for serve-<time>.json/.md (default: print only)")
    args = ap.parse_args(argv)
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model)
    try:
        model = httpx.get(stack.url + "/v1/models", timeout=30).json()["data"][0]
        rng = random.Random(args.seed)
        before = machine_load()
        levels = []
        for c in args.concurrency:
            bodies = completion_bodies([args.prompt_len] * (args.requests or max(8, 4 * c)), args.output_len, rng,
                                       model=model["id"], temperature=args.temperature, draft=args.drafts)
            warm = warm_up(stack.url + "/v1", bodies, c) if args.warmup else 0.0
            samples, wall = asyncio.run(level(stack.url + "/v1", bodies, c))
            row = {"concurrency": c, **summarize(samples, wall, args.prompt_len), "warmup_s": warm}
            levels.append(row)
            print(f"concurrency {c}: {row['completed']}/{row['requests']} ok, {row['output_throughput']:.1f} "
                  f"output tok/s, TTFT median {row['ttft'].get('median_ms', float('nan')):.1f} ms, ITL median "
                  f"{row['itl'].get('median_ms', float('nan')):.1f} ms", flush=True)
        data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": args_record(args),
                "stack": f"{model['id']} (max_model_len {model.get('max_model_len', '?')}), "
                         f"{'running at ' + args.state_dir if args.state_dir else f'started here, TP {args.tp}'}",
                "load": load_line(before, machine_load()), "levels": levels}
        print(markdown(data))
        write_results(args.out, "serve", data, markdown(data))
    finally:
        stack.down()
    return 0 if all(r["completed"] == r["requests"] for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
