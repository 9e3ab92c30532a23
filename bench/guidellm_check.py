"""guidellm — the vLLM community's benchmark client — against `twinspark up`, beside bench/serve.py on the same load
(issue 27: a user who benchmarks twinspark with the usual tool must get figures, and the same figures).

For each concurrency level (guidellm's `synchronous` profile at 1, `concurrent` above), `--rounds` times:
1. guidellm as a user runs it first (`/v1/chat/completions`, synthetic text): how many requests errored;
2. guidellm on `/v1/completions`, synthetic text of `--prompt-len` tokens, `--output-len` tokens (it sends
   `ignore_eos` and `stream_options.continuous_usage_stats`): its TTFT and ITL medians;
3. bench/serve.py's client on the same load — completions of `--prompt-len` random token ids, `--output-len` tokens,
   streamed, at the same concurrency: its TTFT and TPOT medians.
Steps 2 and 3 swap order every round (the shared machine's load drifts); each figure is the median over rounds.
guidellm's ITL is (last token - first token) / (tokens - 1) of a request: what bench.serve calls TPOT (its ITL is
the gap between chunks), so TTFT is compared with TTFT and guidellm's ITL with bench.serve's TPOT.

guidellm is not a twinspark dependency (it brings pandas, pyarrow, datasets, sanic, ...): `pip install guidellm`
to run this. guidellm finds its tokenizer (for the synthetic prompts' lengths) from the model name it sends, so it
is given the checkpoint's path, a name the gateway accepts besides the served one.

    python -m bench.guidellm_check --out bench/results                  # starts a TP 1 stack, drafter none
    python -m bench.guidellm_check --state-dir ~/.local/state/twinspark  # a running stack

Writes guidellm-<time>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import flags
from bench.output import args_record, write_results
from bench.served_load import completion_bodies, level, summarize, warm_up
from bench.stack import add_stack_args, attach_or_start, load_line, machine_load

AGREE = 0.10  # the bound: guidellm's figures within 10% of bench.serve's


def guidellm_command() -> str:
    beside = Path(sys.executable).parent / "guidellm"
    found = str(beside) if beside.is_file() else shutil.which("guidellm")
    if not found:
        raise SystemExit("guidellm is not installed: pip install guidellm")
    return found


def run_guidellm(target: str, model: str, concurrency: int, requests: int, *, fmt: str, prompt_len: int,
                 output_len: int) -> dict:
    """One guidellm run; its JSON report's first benchmark."""
    profile = "kind=synchronous" if concurrency == 1 else f"kind=concurrent,streams={concurrency}"
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        out = Path(tmp) / "report.json"
        argv = [guidellm_command(), "run", "--backend", f"kind=openai_http,target={target},model={model},"
                f"request_format={fmt}", "--profile", profile,
                "--data", f"kind=synthetic_text,prompt_tokens={prompt_len},output_tokens={output_len}",
                "--constraint", f"kind=max_requests,count={requests}", "--output", f"kind=json,path={out}",
                "--disable-console"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=tmp)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{' '.join(argv)}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())["benchmarks"][0]


def guidellm_figures(bench: dict) -> dict:
    m = bench["metrics"]
    return {"requests": m["request_totals"], "ttft_median_ms": m["time_to_first_token_ms"]["successful"]["median"],
            "itl_median_ms": m["inter_token_latency_ms"]["successful"]["median"]}


def serve_figures(url: str, model: str, concurrency: int, requests: int, prompt_len: int, output_len: int,
                  rng: random.Random) -> dict:
    bodies = completion_bodies([prompt_len] * requests, output_len, rng, model=model)
    samples, wall = asyncio.run(level(url + "/v1", bodies, concurrency))
    row = summarize(samples, wall, prompt_len)
    return {"requests": row["requests"], "completed": row["completed"], "errors": row["errors"],
            "ttft_median_ms": row["ttft"].get("median_ms"), "tpot_median_ms": row["tpot"].get("median_ms")}


def one_level(url: str, model: str, path: str, c: int, args: argparse.Namespace, rng: random.Random) -> dict:
    n = args.requests or max(8, 3 * c)
    chat = guidellm_figures(run_guidellm(url, path, c, n, fmt="/v1/chat/completions", prompt_len=args.prompt_len,
                                         output_len=args.output_len))
    rounds = []
    for r in range(args.rounds):
        def g() -> dict:
            return guidellm_figures(run_guidellm(url, path, c, n, fmt="/v1/completions", prompt_len=args.prompt_len,
                                                 output_len=args.output_len))

        def s() -> dict:
            return serve_figures(url, model, c, n, args.prompt_len, args.output_len, rng)
        if r % 2 == 0:
            gl, sv = g(), s()
        else:
            sv, gl = s(), g()
        rounds.append({"guidellm": gl, "serve": sv})
        print(f"concurrency {c}, round {r + 1}: guidellm TTFT {gl['ttft_median_ms']:.1f} ms ITL "
              f"{gl['itl_median_ms']:.1f} ms; bench.serve TTFT {sv['ttft_median_ms']:.1f} ms TPOT "
              f"{sv['tpot_median_ms']:.1f} ms", flush=True)
    med = lambda key, side: statistics.median(x[side][key] for x in rounds)  # noqa: E731
    g_ttft, g_itl = med("ttft_median_ms", "guidellm"), med("itl_median_ms", "guidellm")
    s_ttft, s_tpot = med("ttft_median_ms", "serve"), med("tpot_median_ms", "serve")
    errored = chat["requests"]["errored"] + sum(x["guidellm"]["requests"]["errored"] for x in rounds)
    return {"concurrency": c, "requests_per_run": n, "chat": chat, "rounds": rounds,
            "guidellm_errored": errored, "serve_errors": sum(x["serve"]["requests"] - x["serve"]["completed"]
                                                             for x in rounds),
            "ttft_ms": {"guidellm": g_ttft, "serve": s_ttft, "ratio": g_ttft / s_ttft},
            "itl_ms": {"guidellm": g_itl, "serve_tpot": s_tpot, "ratio": g_itl / s_tpot}}


def markdown(data: dict) -> str:
    a = data["args"]
    lines = [f"# guidellm against twinspark — {data['date']}", "",
             f"- stack: {data['stack']}; guidellm {data['guidellm_version']}; prompts of {a['prompt_len']} tokens "
             f"(guidellm: synthetic text; bench.serve: random ids), {a['output_len']} output tokens (ignore_eos), "
             f"streamed; {a['rounds']} rounds per level, guidellm and bench.serve alternating first",
             f"- {data['load']}", "",
             "| concurrency | guidellm requests (chat + completions) | errored | TTFT median ms guidellm / bench.serve "
             "(ratio) | guidellm ITL / bench.serve TPOT median ms (ratio) | within 10% |",
             "|---:|---:|---:|---|---|---|"]
    for r in data["levels"]:
        total = r["chat"]["requests"]["total"] + sum(x["guidellm"]["requests"]["total"] for x in r["rounds"])
        t, i = r["ttft_ms"], r["itl_ms"]
        ok = abs(t["ratio"] - 1) <= AGREE and abs(i["ratio"] - 1) <= AGREE
        lines.append(f"| {r['concurrency']} | {total} | {r['guidellm_errored']} | {t['guidellm']:.1f} / "
                     f"{t['serve']:.1f} ({t['ratio']:.3f}) | {i['guidellm']:.1f} / {i['serve_tpot']:.1f} "
                     f"({i['ratio']:.3f}) | {'yes' if ok else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.guidellm_check", __doc__)
    add_stack_args(ap)
    ap.set_defaults(tp=1)
    flags.add(ap, flags.CONCURRENCY, "levels (default 1,4)", default="1,4")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: 3 x the level, >= 8)")
    flags.add(ap, flags.PROMPT_LEN, "prompt tokens (default 64)", default="64")
    flags.add(ap, flags.OUTPUT_LEN, "output tokens (default 32)", default="32")
    ap.add_argument("--rounds", type=int, default=3, help="guidellm / bench.serve pairs per level (default 3)")
    flags.add(ap, flags.SEED, "seed of bench.serve's prompts")
    flags.add(ap, flags.OUT, "folder for guidellm-<time>.json/.md (default: print only)")
    args = ap.parse_args(argv)
    version = subprocess.run([guidellm_command(), "--version"], capture_output=True, text=True).stdout.split()[-1]
    # Drafts off in a stack started here: guidellm cannot ask for `"draft": false` per request as bench.serve does.
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model, env={"TWINSPARK_DRAFTER": "none"})
    try:
        info = httpx.get(stack.url + "/v1/models", timeout=30).json()["data"][0]
        model, path = info["id"], info["root"]
        rng = random.Random(args.seed)
        before = machine_load()
        warm_up(stack.url + "/v1", [{"model": model, "prompt": [5] * args.prompt_len, "max_tokens": args.output_len,
                                     "ignore_eos": True, "stream": True}] * max(args.concurrency),
                max(args.concurrency))
        levels = [one_level(stack.url, model, path, c, args, rng) for c in args.concurrency]
        data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "guidellm_version": version, "args": args_record(args),
                "stack": f"{model} ({'running at ' + args.state_dir if args.state_dir else f'started here, TP {args.tp}'})",
                "load": load_line(before, machine_load()), "levels": levels}
        print(markdown(data))
        write_results(args.out, "guidellm", data, markdown(data))
    finally:
        stack.down()
    return 0 if all(r["guidellm_errored"] == 0 for r in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
