"""vllm-router's policies in front of twinspark replicas on a multi-turn chat mix (issue 27): round_robin against
cache_aware against kv_aware (fed by twinspark's own KV events), by the share of prompt tokens the replicas' prefix
caches served and by TTFT.

For each policy a fresh `twinspark up --replicas N --router-policy P` (empty caches, drafter none). The mix:
`--conversations` chats, each opening with one of `--systems` long system prompts (so some prefixes are shared
across chats, as an app's are), `--turns` user turns each, the reply appended to the history before the next
turn; `--concurrency` chats at a time, their turns interleaving. Every turn is a streamed chat completion
(`max_tokens` `--reply-tokens`, greedy, thinking off) whose usage gives prompt and cached tokens; TTFT is the first
chunk carrying token ids. The replies of a random-weight model are gibberish: only the prompts' shape matters.

    python -m bench.router_policies --replicas 2 --out bench/results

Writes router_policies-<time>.json and .md.
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
from bench.stack import load_line, machine_load, twinspark_command
from bench.stats import percentile
from services.common import shared_flags as shared
from services.launcher.ports import free_ports

POLICIES = ("round_robin", "cache_aware", "kv_aware")
OFF = {"enable_thinking": False}


def system_prompt(i: int, clauses: int) -> str:
    return " ".join(f"Policy {i}, rule {k}: answer briefly, cite section {(k * 7 + i) % 23} and never guess about "
                    f"item {k + 3 * i}." for k in range(clauses))


async def turn(client: httpx.AsyncClient, messages: list[dict], reply_tokens: int) -> dict:
    """One streamed chat turn: its TTFT, prompt / cached tokens and reply text."""
    body = {"messages": messages, "max_tokens": reply_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "chat_template_kwargs": OFF, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                if c.get("token_ids") and first is None:
                    first = time.perf_counter() - t0
                text += (c.get("delta") or {}).get("content") or ""
            usage = chunk.get("usage") or usage
    if first is None or usage is None:
        return {"ok": False, "error": "no tokens or no usage"}
    return {"ok": True, "ttft_s": first, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "text": text}


async def run_mix(url: str, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    systems = [system_prompt(i, args.system_clauses) for i in range(args.systems)]
    chats = [[{"role": "system", "content": systems[c % args.systems]}] for c in range(args.conversations)]
    sem = asyncio.Semaphore(args.concurrency)
    results: list[dict] = []

    async def conversation(c: int, client: httpx.AsyncClient) -> None:
        async with sem:
            for t in range(args.turns):
                question = f"Chat {c}, turn {t}: what does rule {rng.randrange(args.system_clauses)} mean for case " \
                           f"{rng.randrange(1000)}?"
                chats[c].append({"role": "user", "content": question})
                out = await turn(client, chats[c], args.reply_tokens)
                results.append({"conversation": c, "turn": t, **{k: v for k, v in out.items() if k != "text"}})
                chats[c].append({"role": "assistant", "content": out.get("text", "")})
                await asyncio.sleep(rng.uniform(0, 0.2))  # users do not answer at once: turns interleave

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(conversation(c, client) for c in range(args.conversations)))
    return results


def summarize(policy: str, results: list[dict], wall_s: float, started_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] * 1e3 for r in ok]
    later = [r for r in ok if r["turn"] > 0]
    return {"policy": policy, "requests": len(results), "ok": len(ok), "up_s": started_s, "wall_s": wall_s,
            "prompt_tokens": sum(r["prompt"] for r in ok), "cached_tokens": sum(r["cached"] for r in ok),
            "cached_share": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
            "cached_share_later_turns": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
            "ttft_p50_ms": statistics.median(ttft) if ttft else None, "ttft_p99_ms": percentile(ttft, 0.99) if ttft else None,
            "errors": sorted({r["error"] for r in results if not r["ok"]})}


def one_policy(policy: str, args: argparse.Namespace) -> dict:
    state = Path(tempfile.mkdtemp(prefix=f"twinspark-router-{policy}-"))
    port = free_ports(1)[0]
    argv = [twinspark_command(), "up", "--detach", "--replicas", str(args.replicas), "--router-policy", policy, "--port",
            str(port), "--state-dir", str(state), "--drafter", "none", "--tp", "1"]
    if args.model:
        argv += ["--model", args.model]
    t0 = time.monotonic()
    up = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    if up.returncode != 0:
        raise RuntimeError(f"twinspark up failed:\n{up.stdout}\n{up.stderr}")
    started = time.monotonic() - t0
    try:
        t1 = time.monotonic()
        results = asyncio.run(run_mix(f"http://127.0.0.1:{port}", args))
        row = summarize(policy, results, time.monotonic() - t1, started)
    finally:
        subprocess.run([twinspark_command(), "down", "--state-dir", str(state)], capture_output=True, timeout=180)
        shutil.rmtree(state, ignore_errors=True)
    print(f"{policy}: {row['ok']}/{row['requests']} ok, cached share {row['cached_share']:.3f} (later turns "
          f"{row['cached_share_later_turns']:.3f}), TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} "
          f"ms", flush=True)
    return row


def markdown(data: dict) -> str:
    a = data["args"]
    lines = [f"# vllm-router policies in front of twinspark — {data['date']}", "",
             f"- {a['replicas']} replicas (`twinspark up --replicas {a['replicas']}`, TP 1, drafter none, "
             f"{data['model']}), a fresh run per policy; vllm-router {data['router_version']}",
             f"- mix: {a['conversations']} chats × {a['turns']} turns, {a['concurrency']} at a time, {a['systems']} "
             f"shared system prompts of {a['system_clauses']} rules, replies of {a['reply_tokens']} tokens, "
             "streamed, greedy, thinking off",
             f"- {data['load']}", "",
             "| policy | requests ok | prompt tokens | cached tokens | cached share | cached share, turns ≥ 2 | "
             "TTFT p50 ms | TTFT p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["policies"]:
        lines.append(f"| {r['policy']} | {r['ok']}/{r['requests']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                     f"{r['cached_share']:.3f} | {r['cached_share_later_turns']:.3f} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p99_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.router_policies", __doc__)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default %(default)s)")
    ap.add_argument("--replicas", type=int, default=2)
    flags.add(ap, shared.MODEL, "checkpoint (default: the tiny one)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--systems", type=int, default=2, help="distinct system prompts the chats share")
    ap.add_argument("--system-clauses", type=int, default=14, help="rules per system prompt (~35 tokens each)")
    ap.add_argument("--reply-tokens", type=int, default=24)
    flags.add(ap, flags.SEED, "seed of the chats' questions and pauses")
    flags.add(ap, flags.OUT, "folder for router_policies-<time>.json/.md (default: print only)")
    args = ap.parse_args(argv)
    version = subprocess.run([sys.executable, "-m", "pip", "show", "vllm-router"], capture_output=True,
                             text=True).stdout.split("Version: ")[-1].split()[0]
    before = machine_load()
    rows = [one_policy(p.strip(), args) for p in args.policies.split(",") if p.strip()]
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "router_version": version,
            "model": args.model or "the tiny checkpoint", "load": load_line(before, machine_load()),
            "args": args_record(args), "policies": rows}
    print(markdown(data))
    write_results(args.out, "router_policies", data, markdown(data))
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
