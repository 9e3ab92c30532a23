"""Soak bench: a fixed time of mixed load at 4x the lane count against `twinspark up`, watching memory and losses.

Clients (asyncio + httpx, 4x the scheduler's request slots by default) loop for --duration seconds, each request
drawn from a seeded mix: chat (text) or completions (token ids), prompt lengths short / medium / long, streamed or
not, and some cut short on purpose — a stream cancelled after a few chunks, a non-streamed request whose client
disconnects after a random delay. Every request must end with a reply, a 429 or a 503 (or the client's own cut):
anything else is "lost". Every 10 s the RSS of every process of the stack is sampled; at the end the load stops and
`kv_cache_usage_perc` must come back to 0.

    python -m bench.soak --duration 1800 --out bench/results                    # starts a CPU stack, TP 2
    python -m bench.soak --state-dir ~/.local/state/twinspark --duration 600   # a running stack

Writes soak-<time>.json and .md: requests, outcomes and HTTP codes, p50 / p99 latency (complete replies; time to
first token for streams), RSS per process over time, memory drift (mean of the last 10 minutes against the first
10), kv usage at the end, and the machine's load (it is shared).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench import flags
from bench.output import write_results
from bench.stack import Stack, add_stack_args, attach_or_start, load_line, machine_load, rss_bytes
from bench.stats import percentile

PROMPT_WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
LENGTHS = {"short": (4, 24), "medium": (100, 300), "long": (600, 1000)}  # prompt tokens (ids) / words (text)
RSS_EVERY_S = 10.0
WINDOW_S = 600.0  # the memory check compares the first and the last 10 minutes


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # reply / cancelled / disconnected / lost
    codes: Counter = field(default_factory=Counter)  # HTTP status (or the client error's name)
    latency_s: list[float] = field(default_factory=list)  # complete non-streamed replies
    ttft_s: list[float] = field(default_factory=list)  # streams: request -> first content chunk
    stream_s: list[float] = field(default_factory=list)  # complete streams
    lost: list[str] = field(default_factory=list)


def _request(rng: random.Random, model: str, window: int) -> tuple[str, dict, str]:
    """(path, body, plan) — plan: "whole", "cancel" (a stream cut after a few chunks) or "disconnect". Prompts stay
    inside the served window (a text word may take up to ~4 tokens; the template adds a few more)."""
    size = rng.choices(list(LENGTHS), weights=[6, 3, 1])[0]
    n = rng.randint(*LENGTHS[size])
    stream = rng.random() < 0.5
    body: dict = {"model": model, "max_tokens": rng.randint(8, 64), "temperature": rng.choice([0, 0.7]),
                  "stream": stream, "ignore_eos": rng.random() < 0.5}
    room = window - body["max_tokens"] - 32
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        words = max(1, min(n, room // 4))
        body["messages"] = [{"role": "user", "content": " ".join(rng.choices(PROMPT_WORDS, k=words))}]
    else:
        path = "/v1/completions"
        body["prompt"] = [rng.randrange(100, 900) for _ in range(max(1, min(n, room)))]
    cut = rng.random()
    plan = "whole" if cut >= 0.1 else ("cancel" if stream else "disconnect")
    return path, body, plan


async def _one(client: httpx.AsyncClient, rng: random.Random, model: str, window: int, tally: Tally) -> None:
    path, body, plan = _request(rng, model, window)
    t0 = time.monotonic()
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as r:
                tally.codes[str(r.status_code)] += 1
                if r.status_code != 200:
                    await r.aread()
                    _refusal(r.status_code, tally, path)
                    return
                chunks, first, done = 0, None, False
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        if '"error"' in line[:20]:
                            tally.outcomes["stream_error_event"] += 1
                            tally.lost.append(f"stream error event: {line[:200]}")
                            return
                        chunks += 1
                        first = first or time.monotonic() - t0
                    elif line == "data: [DONE]":
                        done = True
                    if plan == "cancel" and chunks >= 3:
                        tally.outcomes["cancelled"] += 1  # leaving the block closes the connection mid-stream
                        return
                if done:
                    tally.outcomes["reply"] += 1
                    tally.stream_s.append(time.monotonic() - t0)
                    if first is not None:
                        tally.ttft_s.append(first)
                else:
                    tally.outcomes["lost"] += 1
                    tally.lost.append(f"stream ended without [DONE] ({path})")
        else:
            work = client.post(path, json=body)
            if plan == "disconnect":
                try:
                    r = await asyncio.wait_for(work, rng.uniform(0.05, 2.0))
                except asyncio.TimeoutError:
                    tally.outcomes["disconnected"] += 1
                    return
            else:
                r = await work
            tally.codes[str(r.status_code)] += 1
            if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"):
                tally.outcomes["reply"] += 1
                tally.latency_s.append(time.monotonic() - t0)
            else:
                _refusal(r.status_code, tally, path)
    except httpx.HTTPError as exc:
        tally.codes[type(exc).__name__] += 1
        tally.outcomes["lost"] += 1
        tally.lost.append(f"{type(exc).__name__}: {exc} ({path})")


def _refusal(status: int, tally: Tally, path: str) -> None:
    if status in (429, 503):
        tally.outcomes[f"refused_{status}"] += 1
    else:
        tally.outcomes["lost"] += 1
        tally.lost.append(f"HTTP {status} ({path})")


async def _client(stack_url: str, model: str, window: int, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=stack_url, timeout=httpx.Timeout(300.0)) as client:
        while time.monotonic() < until:
            await _one(client, rng, model, window, tally)
            if tally.outcomes.get("refused_429", 0) and rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0.1, 1.0))  # a polite client backs off now and then


async def _sample_rss(stack: Stack, until: float, series: dict[str, list[tuple[float, int]]], t0: float) -> None:
    while True:
        now = time.monotonic()
        for name, pid in stack.processes().items():
            rss = rss_bytes(pid)
            if rss is not None:
                series.setdefault(name, []).append((round(now - t0, 1), rss))
        if now >= until:
            return
        await asyncio.sleep(min(RSS_EVERY_S, max(0.0, until - now)))


def _drift(points: list[tuple[float, int]], duration: float) -> dict:
    """Mean RSS of the first and last windows (10 minutes, or a third of a shorter run) and their ratio."""
    w = min(WINDOW_S, duration / 3)
    first = [r for t, r in points if t < w]
    last = [r for t, r in points if t >= duration - w]
    if not first or not last:
        return {}
    a, b = statistics.mean(first), statistics.mean(last)
    return {"first_mb": round(a / 2**20, 1), "last_mb": round(b / 2**20, 1), "change": round(b / a - 1, 4)}


def _pct(xs: list[float], q: float) -> float | None:
    return round(percentile(xs, q), 3) if xs else None


async def soak(stack: Stack, duration: float, clients: int, seed: int) -> dict:
    served = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]
    model, window = served["id"], served["max_model_len"]
    tally, series = Tally(), {}
    t0 = time.monotonic()
    until = t0 + duration
    pids, restarts = stack.processes(), stack.restarts()
    sampler = asyncio.create_task(_sample_rss(stack, until, series, t0))
    await asyncio.gather(*(_client(stack.url, model, window, seed * 1000 + i, until, tally) for i in range(clients)))
    ran = time.monotonic() - t0
    await sampler
    # Load is off: every request has ended, so the pool must drain to empty.
    usage, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        usage = stack.health().get("kv_cache_usage_perc")
        if usage == 0:
            break
        await asyncio.sleep(0.5)
    changed = sum(1 for k, v in stack.processes().items() if pids.get(k) != v and k != "supervisor")
    return {"ran_s": round(ran, 1), "tally": tally, "rss": series, "kv_cache_usage_perc_end": usage,
            "restarts": sum(stack.restarts().values()) - sum(restarts.values()) + changed}


def markdown(r: dict) -> str:
    s = r["summary"]
    lines = [f"# Soak bench {r['when']}", "",
             f"{r['duration_s']:.0f} s of load ({s['duration_s']:.0f} s until the last request ended), "
             f"{r['clients']} clients (4 x {r['lanes']} lanes) against "
             f"`twinspark up` (TP {r['tp']}, CPU, tiny model): prompts short / medium / long (6:3:1), half "
             "streamed, 10% cut by the client (streams cancelled after 3 chunks, others disconnected).", "",
             "| requests | replies | 429 | 503 | cancelled | disconnected | lost | restarts | kv usage at end |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {s['requests']} | {s['replies']} | {s['refused_429']} | {s['refused_503']} | {s['cancelled']} | "
             f"{s['disconnected']} | {s['lost']} | {s['restarts']} | {s['kv_cache_usage_perc_end']} |", "",
             f"Latency (s): non-streamed replies p50 {s['latency_p50_s']} / p99 {s['latency_p99_s']}; streams "
             f"time to first token p50 {s['ttft_p50_s']} / p99 {s['ttft_p99_s']}, whole stream p50 "
             f"{s['stream_p50_s']} / p99 {s['stream_p99_s']}. HTTP codes: "
             f"{', '.join(f'{k}: {v}' for k, v in r['codes'].items())}.", "",
             "| process | RSS first window (MB) | RSS last window (MB) | change |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v.get('first_mb')} | {v.get('last_mb')} | {v.get('change', 0) * 100:+.1f}% |"
              for k, v in r["memory"].items()]
    lines += ["", load_line(r["load_before"], r["load_after"])]
    if r["lost_examples"]:
        lines += ["", "Lost requests (first ones): " + "; ".join(r["lost_examples"][:5])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.soak", __doc__)
    add_stack_args(ap)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    ap.add_argument("--clients", type=int, default=None, help="concurrent clients (default 4 x the lanes)")
    flags.add(ap, flags.SEED, "seed of the request mix (default 7)", default="7")
    flags.add(ap, flags.OUT, "directory for soak-<time>.json and .md (default: print only)")
    args = ap.parse_args(argv)
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model)
    try:
        lanes = stack.health()["pool"]["total_slots"]  # request slots: how many requests run at once
        clients = args.clients or 4 * lanes
        load_before = machine_load()
        res = asyncio.run(soak(stack, args.duration, clients, args.seed))
    finally:
        stack.down()
    t: Tally = res["tally"]
    o = t.outcomes
    summary = {"duration_s": res["ran_s"], "requests": sum(o.values()), "replies": o["reply"],
               "refused_429": o["refused_429"], "refused_503": o["refused_503"], "cancelled": o["cancelled"],
               "disconnected": o["disconnected"], "lost": o["lost"] + o["stream_error_event"],
               "restarts": res["restarts"], "kv_cache_usage_perc_end": res["kv_cache_usage_perc_end"],
               "latency_p50_s": _pct(t.latency_s, 0.5), "latency_p99_s": _pct(t.latency_s, 0.99),
               "ttft_p50_s": _pct(t.ttft_s, 0.5), "ttft_p99_s": _pct(t.ttft_s, 0.99),
               "stream_p50_s": _pct(t.stream_s, 0.5), "stream_p99_s": _pct(t.stream_s, 0.99)}
    memory = {name: _drift(points, args.duration) for name, points in res["rss"].items()}  # samples span it
    summary["max_memory_change"] = max((abs(m.get("change", 0)) for m in memory.values()), default=0)
    out = {"bench": "soak", "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "tp": args.tp, "lanes": lanes, "clients": clients, "seed": args.seed, "duration_s": args.duration,
           "summary": summary,
           "outcomes": dict(o), "codes": dict(sorted(t.codes.items())), "memory": memory,
           "rss_samples": {k: v for k, v in res["rss"].items()}, "lost_examples": t.lost[:20],
           "load_before": load_before, "load_after": machine_load()}
    print(json.dumps(summary))
    write_results(args.out, "soak", out, markdown(out))
    ok = summary["lost"] == 0 and summary["restarts"] == 0 and summary["kv_cache_usage_perc_end"] == 0 \
        and summary["max_memory_change"] <= 0.05
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
