"""Soak bench: a fixed time of mixed load against `twinspark up`, watching memory, latency and losses minute by minute.

Clients (asyncio + httpx; 4x the scheduler's request slots by default, --clients) loop for --duration seconds, each
request drawn from a seeded mix (bench/soak_mix.py):
- `--mix default`: chat (text) or completions (token ids), prompts short / medium / long, streamed or not, and some
  cut short on purpose — a stream cancelled after a few chunks, a non-streamed request whose client disconnects
  after a random delay. Every request must end with a reply, a 429 or a 503 (or the client's own cut): anything
  else is "lost".
- `--mix gpu` (issue 54's GPU soak): prompts of 100 tokens to 32k and one of 200k, n = 2, logprobs, tools and
  json_schema with a thinking budget, multi-turn conversations, an image when the model reads them; a clean 4xx
  (OpenAI's error shape: a prompt past the window, say) counts as refused, each code apart. `--max-prompt` caps the
  lengths (not the 200k one) so that the mix runs on a tiny model's window.

Every 10 s it samples the RSS of every process of the stack, the gateway's /metrics (KV pool use, running and waiting
requests, preemptions when the scheduler counts them) and the GPUs' memory (nvidia-smi, when there is one). At the
end the load stops and `kv_cache_usage_perc` must come back to 0.

    python -m bench.soak --duration 1800 --out bench/results                    # starts a CPU stack, TP 2
    python -m bench.soak --state-dir ~/.local/state/twinspark --duration 600   # a running stack
    python -m bench.soak --device cuda --tp 1 --model /tmp/soak-config --random-weights exl3:2.5+fp8 \\
        --mix gpu --clients 32 --duration 420 --out $OUT                      # the GPU soak (bench/gpu_check.sh soak)

Writes soak-<time>.json and .md: requests, outcomes and HTTP codes, p50 / p99 latency (complete replies; time to
first token for streams), a table per minute (sent / answered / refused by code / cut / lost, 5xx, TTFT and ITL
p50 / p99, GPU memory, pool use, RSS per process), the drifts after warm-up (--warmup-minutes: first steady minute
against the last), RSS drift over the run's first and last windows, kv usage at the end, and the machine's load.
The GPU mix's exit status is issue 54's Done-when: 0 lost, 0 5xx, GPU memory drift <= 1%, host RSS drift <= 3%,
p99 ITL <= 2.5x the median, in the steady minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench import flags
from bench.output import write_results
from bench.soak_mix import DefaultMix, GpuMix, GpuMixState, Outcome, Plan
from bench.stack import (Stack, add_stack_args, add_started_stack_args, attach_or_start, load_line, machine_load,
                         rss_bytes, started_stack_env)
from bench.stats import percentile

RSS_EVERY_S = 10.0
WINDOW_S = 600.0  # the whole-run memory check compares the first and the last 10 minutes
MINUTE_S = 60.0
CLIENT_TIMEOUT_S = 600.0  # a 200k-token prompt waits for the pool, then prefills
DONE_WHEN = {"gpu_memory_drift": 0.01, "rss_drift": 0.03, "itl_p99_over_median": 2.5}  # issue 54
CUT = ("cancelled", "disconnected")
LOST = ("lost", "stream_error_event")


@dataclass
class Record:
    """One request, start to end (seconds since the load began)."""

    kind: str
    start_s: float
    end_s: float = 0.0
    outcome: str = "lost"  # reply / cancelled / disconnected / refused_<status> / lost / stream_error_event
    code: str = ""  # HTTP status or the client error's name ("" when the client cut it before an answer)
    ttft_s: float | None = None  # streams: to the first chunk with tokens
    itl_s: list[float] = field(default_factory=list)  # streams: gaps between a choice's token chunks
    text: str = ""  # choice 0's content
    message: str = ""  # a refusal's error message, or why it is lost
    refusal: str = ""  # "400 context_length_exceeded": the status and the error's code
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the reply had usage


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # reply / cancelled / disconnected / refused_* / lost
    codes: Counter = field(default_factory=Counter)  # HTTP status (or the client error's name)
    latency_s: list[float] = field(default_factory=list)  # complete non-streamed replies
    ttft_s: list[float] = field(default_factory=list)  # complete streams: request -> first content chunk
    stream_s: list[float] = field(default_factory=list)  # complete streams
    lost: list[str] = field(default_factory=list)
    refusals: Counter = field(default_factory=Counter)  # "400 context_length_exceeded" -> count
    records: list[Record] = field(default_factory=list)

    def add(self, r: Record, streamed: bool) -> None:
        self.records.append(r)
        self.outcomes[r.outcome] += 1
        if r.code:
            self.codes[r.code] += 1
        if r.outcome in LOST:
            self.lost.append(r.message)
        elif r.refusal:
            self.refusals[r.refusal] += 1
        elif r.outcome == "reply" and streamed:
            self.stream_s.append(r.end_s - r.start_s)
            if r.ttft_s is not None:
                self.ttft_s.append(r.ttft_s)
        elif r.outcome == "reply":
            self.latency_s.append(r.end_s - r.start_s)


@dataclass
class Sample:
    """What the sampler saw at `t` seconds into the load."""

    t: float
    rss: dict[str, int]
    gpu_mib: int | None = None  # used, all GPUs together
    metrics: dict[str, float] = field(default_factory=dict)  # kv_cache_usage_perc, running, waiting, preemptions


# ------------------------------------------------------------------------------------------------ requests


def _refused(r: Record, status: int, raw: bytes, plan: Plan) -> None:
    """A non-200 answer: 429 / 503 are refusals; a clean 4xx too when the mix allows it; anything else is lost."""
    try:
        error = json.loads(raw)["error"]
        clean = isinstance(error.get("message"), str)
    except (ValueError, KeyError, TypeError, AttributeError):
        error, clean = {}, False
    if status in (429, 503) or (plan.refusable and 400 <= status < 500 and clean):
        r.outcome = f"refused_{status}"
        r.message = str(error.get("message", ""))[:300]
        r.refusal = f"{status} {error.get('code') or error.get('type') or ''}".strip()
    else:
        r.outcome = "lost"
        r.message = f"HTTP {status} ({plan.path}, {plan.kind}): {raw[:200]!r}"


def _usage(r: Record, event: dict) -> None:
    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        r.cached_tokens = details["cached_tokens"]


async def _stream(client: httpx.AsyncClient, plan: Plan, r: Record, t0: float) -> None:
    body = {**plan.body, "return_token_ids": True}  # a chunk's ids say it carries tokens, text or not
    if plan.kind.startswith("turn"):  # the usage chunk says how much of the prompt the prefix cache held
        body["stream_options"] = {"include_usage": True}
    async with client.stream("POST", plan.path, json=body) as resp:
        r.code = str(resp.status_code)
        if resp.status_code != 200:
            _refused(r, resp.status_code, await resp.aread(), plan)
            return
        chunks, last, done, text = 0, {}, False, []
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                r.outcome, r.message = "stream_error_event", f"stream error event: {line[:200]}"
                return
            now = time.monotonic()
            for choice in event.get("choices") or []:
                if not choice.get("token_ids"):
                    continue
                i = choice.get("index", 0)
                if r.ttft_s is None:
                    r.ttft_s = now - t0
                elif i in last:  # n = 2: each choice's gaps apart
                    r.itl_s.append(now - last[i])
                last[i] = now
                chunks += 1
                if i == 0:
                    text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
            _usage(r, event)
            if plan.cut == "cancel" and chunks >= plan.cut_after:
                r.outcome = "cancelled"  # leaving the block closes the connection mid-stream
                return
        r.text = "".join(text)
        if done:
            r.outcome = "reply"
        else:
            r.outcome, r.message = "lost", f"stream ended without [DONE] ({plan.path}, {plan.kind})"


async def _whole(client: httpx.AsyncClient, plan: Plan, r: Record, rng: random.Random) -> None:
    work = client.post(plan.path, json=plan.body)
    if plan.cut == "disconnect":
        try:
            resp = await asyncio.wait_for(work, rng.uniform(0.05, 2.0))
        except asyncio.TimeoutError:
            r.outcome = "disconnected"
            return
    else:
        resp = await work
    r.code = str(resp.status_code)
    if resp.status_code != 200:
        _refused(r, resp.status_code, resp.content, plan)
        return
    data = resp.json()
    reasons = {c.get("finish_reason") for c in data.get("choices") or [{}]}
    if reasons <= {"stop", "length", "tool_calls"}:
        r.outcome = "reply"
        first = data["choices"][0]
        r.text = (first.get("message") or {}).get("content") or first.get("text") or ""
        _usage(r, data)
    else:
        r.outcome, r.message = "lost", f"HTTP 200 with finish reasons {sorted(map(str, reasons))} ({plan.path})"


async def _one(client: httpx.AsyncClient, plan: Plan, rng: random.Random, load0: float, late_by: float,
               tally: Tally) -> Record:
    t0 = time.monotonic()
    r = Record(plan.kind, t0 - load0)
    streamed = bool(plan.body.get("stream"))
    try:
        work = _stream(client, plan, r, t0) if streamed else _whole(client, plan, r, rng)
        await asyncio.wait_for(work, timeout=max(1.0, late_by - t0))
    except asyncio.TimeoutError:
        r.code, r.outcome = "unanswered", "lost"
        r.message = f"still unanswered {late_by - load0:.0f} s into the run ({plan.path}, {plan.kind})"
    except httpx.HTTPError as exc:
        r.code, r.outcome = type(exc).__name__, "lost"
        r.message = f"{type(exc).__name__}: {exc} ({plan.path}, {plan.kind})"
    r.end_s = time.monotonic() - load0
    tally.add(r, streamed)
    return r


async def _client(stack_url: str, mix: DefaultMix | GpuMix, seed: int, load0: float, until: float, late_s: float,
                  tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=stack_url, timeout=httpx.Timeout(CLIENT_TIMEOUT_S)) as client:
        while time.monotonic() < until:
            plan = mix.next(rng)
            r = await _one(client, plan, rng, load0, until + late_s, tally)
            mix.after(plan, Outcome(r.outcome, r.text, r.message))
            if tally.outcomes.get("refused_429", 0) and rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0.1, 1.0))  # a polite client backs off now and then


# ------------------------------------------------------------------------------------------------ sampling


def scrape(text: str) -> dict[str, float]:
    """The gateway's /metrics (Prometheus text) -> the figures a soak watches, vLLM's names (labels summed)."""
    wanted = {"vllm:kv_cache_usage_perc": "kv_cache_usage_perc", "vllm:num_requests_running": "running",
              "vllm:num_requests_waiting": "waiting", "vllm:num_preemptions_total": "preemptions",
              "vllm:num_preemptions": "preemptions"}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, _, value = line.rpartition(" ")
            key = wanted.get(name_labels.split("{", 1)[0])
            if key:
                out[key] = out.get(key, 0.0) + float(value)
    return out


def gpu_reader() -> Callable[[], int | None] | None:
    """Used GPU memory in MiB, all GPUs together (nvidia-smi: the ranks are other processes); None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    from bench.whole_model import gpu_memory_mib  # torch comes with it: only where there is a GPU

    def read() -> int | None:
        try:
            return sum(g["used_mib"] for g in gpu_memory_mib())
        except (OSError, ValueError, subprocess.SubprocessError):  # a failed query: a missing sample, not a failure
            return None
    return read


async def _sample(stack: Stack, until: float, load0: float, samples: list[Sample]) -> None:
    gpu = gpu_reader()
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        while True:
            now = time.monotonic()
            s = Sample(round(now - load0, 1), {name: rss for name, pid in stack.processes().items()
                                               if (rss := rss_bytes(pid)) is not None})
            if gpu is not None:
                s.gpu_mib = await asyncio.to_thread(gpu)
            try:
                s.metrics = scrape((await client.get("/metrics")).text)
            except httpx.HTTPError:
                pass  # a busy gateway's slow scrape: this sample has no pool figures
            samples.append(s)
            if now >= until:
                return
            await asyncio.sleep(min(RSS_EVERY_S, max(0.0, until - now)))


def _rss_series(samples: list[Sample]) -> dict[str, list[tuple[float, int]]]:
    series: dict[str, list[tuple[float, int]]] = {}
    for s in samples:
        for name, rss in s.rss.items():
            series.setdefault(name, []).append((s.t, rss))
    return series


def _drift(points: list[tuple[float, int]], duration: float) -> dict:
    """Mean RSS of the first and last windows (10 minutes, or a third of a shorter run) and their ratio."""
    w = min(WINDOW_S, duration / 3)
    first = [r for t, r in points if t < w]
    last = [r for t, r in points if t >= duration - w]
    if not first or not last:
        return {}
    a, b = statistics.mean(first), statistics.mean(last)
    return {"first_mb": round(a / 2**20, 1), "last_mb": round(b / 2**20, 1), "change": round(b / a - 1, 4)}


def _pct(xs: list[float], q: float, scale: float = 1.0) -> float | None:
    return round(percentile(xs, q) * scale, 3) if xs else None


# ------------------------------------------------------------------------------------------------ per minute


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


def _minute_memory(samples: list[Sample]) -> dict:
    """The memory and pool figures of one minute's samples (means; pool use and queues also at their peak)."""
    metric = {k: [s.metrics[k] for s in samples if k in s.metrics]
              for k in ("kv_cache_usage_perc", "running", "waiting", "preemptions")}
    gpu = [s.gpu_mib for s in samples if s.gpu_mib is not None]
    names = sorted({n for s in samples for n in s.rss})
    return {"gpu_mib": round(statistics.fmean(gpu)) if gpu else None,
            "rss_mb": {n: round(statistics.fmean(s.rss[n] for s in samples if n in s.rss) / 2**20, 1) for n in names},
            "kv_usage_mean": _mean(metric["kv_cache_usage_perc"]),
            "kv_usage_max": max(metric["kv_cache_usage_perc"], default=None),
            "running_max": max(metric["running"], default=None), "waiting_max": max(metric["waiting"], default=None),
            "preemptions": max(metric["preemptions"], default=None)}


def per_minute(records: list[Record], samples: list[Sample], ran_s: float) -> tuple[list[dict], list[list[float]]]:
    """A row per minute of the run: requests by the minute they were sent (`sent`) and ended (the rest), the
    samples taken in it; and each minute's inter-token gaps (for the steady minutes' ratio)."""
    n = max(1, math.ceil(ran_s / MINUTE_S))

    def at(t: float) -> int:
        return min(n - 1, max(0, int(t // MINUTE_S)))

    rows = [{"minute": i + 1, "sent": 0, "answered": 0, "refused": Counter(), "cut": 0, "lost": 0, "5xx": 0}
            for i in range(n)]
    ttft: list[list[float]] = [[] for _ in range(n)]
    itl: list[list[float]] = [[] for _ in range(n)]
    for r in records:
        rows[at(r.start_s)]["sent"] += 1
        i = at(r.end_s)
        row = rows[i]
        if r.outcome == "reply":
            row["answered"] += 1
        elif r.outcome in CUT:
            row["cut"] += 1
        elif r.outcome.startswith("refused_"):
            row["refused"][r.code] += 1
        else:
            row["lost"] += 1
        row["5xx"] += int(r.code.isdigit() and int(r.code) >= 500)
        if r.ttft_s is not None:
            ttft[i].append(r.ttft_s)
        itl[i] += r.itl_s
    for i, row in enumerate(rows):
        row["refused"] = dict(sorted(row["refused"].items()))
        row.update(ttft_p50_s=_pct(ttft[i], 0.5), ttft_p99_s=_pct(ttft[i], 0.99), itl_p50_ms=_pct(itl[i], 0.5, 1e3),
                   itl_p99_ms=_pct(itl[i], 0.99, 1e3))
        row.update(_minute_memory([s for s in samples if at(s.t) == i]))
    return rows, itl


def steady(rows: list[dict], itl: list[list[float]], warmup: int, load_s: float) -> dict:
    """Issue 54's figures over the steady minutes: after `warmup` minutes, each with at least half a minute of
    load in it. Drifts compare the first steady minute with the last; None where fewer than two."""
    keep = [i for i, row in enumerate(rows) if i >= warmup and i * MINUTE_S + MINUTE_S / 2 <= load_s]
    out: dict = {"minutes": [rows[i]["minute"] for i in keep], "gpu_memory_drift": None, "rss_drift": {},
                 "itl_p50_ms": None, "itl_p99_ms": None, "itl_p99_over_median": None}
    if len(keep) >= 2:
        a, b = rows[keep[0]], rows[keep[-1]]
        if a["gpu_mib"] and b["gpu_mib"] is not None:
            out["gpu_memory_drift"] = round(b["gpu_mib"] / a["gpu_mib"] - 1, 4)
        out["rss_drift"] = {n: round(b["rss_mb"][n] / mb - 1, 4) for n, mb in a["rss_mb"].items()
                            if mb and n in b["rss_mb"]}
    gaps = [g for i in keep for g in itl[i]]
    if gaps:
        p50, p99 = percentile(gaps, 0.5), percentile(gaps, 0.99)
        out.update(itl_p50_ms=round(p50 * 1e3, 3), itl_p99_ms=round(p99 * 1e3, 3),
                   itl_p99_over_median=round(p99 / p50, 3) if p50 > 0 else None)
    return out


def done_when(summary: dict, st: dict) -> dict:
    """Issue 54's Done-when, each check True / False, None where the run could not measure it."""
    rss = max((abs(v) for v in st["rss_drift"].values()), default=None)
    gpu, ratio = st["gpu_memory_drift"], st["itl_p99_over_median"]
    return {"lost": summary["lost"] == 0, "5xx": summary["5xx"] == 0,
            "gpu_memory_flat": None if gpu is None else abs(gpu) <= DONE_WHEN["gpu_memory_drift"],
            "rss_flat": None if rss is None else rss <= DONE_WHEN["rss_drift"],
            "itl_tail": None if ratio is None else ratio <= DONE_WHEN["itl_p99_over_median"]}


def by_kind(records: list[Record]) -> dict[str, dict[str, int]]:
    out: dict[str, Counter] = {}
    for r in records:
        c = out.setdefault(r.kind, Counter())
        c["sent"] += 1
        c["answered" if r.outcome == "reply" else "cut" if r.outcome in CUT else
          "refused" if r.outcome.startswith("refused_") else "lost"] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


# ------------------------------------------------------------------------------------------------ the run


async def soak(stack: Stack, duration: float, clients: int, seed: int, mix: str, max_prompt: int | None,
               late_s: float) -> dict:
    served = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]
    model, window = served["id"], served["max_model_len"]
    state = GpuMixState()

    def make() -> DefaultMix | GpuMix:  # one per client: a GPU-mix client keeps its own conversation
        return GpuMix(model, window, state, max_prompt) if mix == "gpu" else DefaultMix(model, window)

    tally, samples = Tally(), []
    load0 = time.monotonic()
    until = load0 + duration
    pids, restarts = stack.processes(), stack.restarts()
    sampler = asyncio.create_task(_sample(stack, until, load0, samples))
    await asyncio.gather(*(_client(stack.url, make(), seed * 1000 + i, load0, until, late_s, tally)
                           for i in range(clients)))
    ran = time.monotonic() - load0
    await sampler
    # Load is off: every request has ended, so the pool must drain to empty.
    usage, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            usage = stack.health().get("kv_cache_usage_perc")
        except httpx.HTTPError:  # a gateway gone: the restarts count says so; the figures so far are still written
            usage = None
        if usage == 0:
            break
        await asyncio.sleep(0.5)
    changed = sum(1 for k, v in stack.processes().items() if pids.get(k) != v and k != "supervisor")
    return {"ran_s": round(ran, 1), "load_s": duration, "tally": tally, "samples": samples,
            "kv_cache_usage_perc_end": usage, "window": window, "model": model,
            "images": state.images, "image_note": state.image_note,
            "restarts": sum(stack.restarts().values()) - sum(restarts.values()) + changed}


def _turns(records: list[Record]) -> dict:
    """Later conversation turns answered with usage: how many prompt tokens came from the prefix cache."""
    turns = [r for r in records if r.kind == "turn_next" and r.outcome == "reply" and r.cached_tokens is not None]
    return {"answered_with_usage": len(turns), "cached_tokens": sum(r.cached_tokens or 0 for r in turns),
            "with_cache_hit": sum(1 for r in turns if r.cached_tokens)}


def _long(records: list[Record]) -> dict | None:
    r = next((r for r in records if r.kind == "long"), None)
    return None if r is None else {"outcome": r.outcome, "code": r.code, "seconds": round(r.end_s - r.start_s, 2),
                                   "message": r.message[:200]}


def summarize(res: dict, warmup: int) -> tuple[dict, list[dict], dict]:
    t: Tally = res["tally"]
    o = t.outcomes
    refused = {k.removeprefix("refused_"): v for k, v in sorted(o.items()) if k.startswith("refused_")}
    summary = {"duration_s": res["ran_s"], "requests": sum(o.values()), "replies": o["reply"],
               "refused_429": o["refused_429"], "refused_503": o["refused_503"], "refused": refused,
               "cancelled": o["cancelled"], "disconnected": o["disconnected"],
               "lost": o["lost"] + o["stream_error_event"],
               "5xx": sum(v for k, v in t.codes.items() if k.isdigit() and int(k) >= 500),
               "restarts": res["restarts"], "kv_cache_usage_perc_end": res["kv_cache_usage_perc_end"],
               "latency_p50_s": _pct(t.latency_s, 0.5), "latency_p99_s": _pct(t.latency_s, 0.99),
               "ttft_p50_s": _pct(t.ttft_s, 0.5), "ttft_p99_s": _pct(t.ttft_s, 0.99),
               "stream_p50_s": _pct(t.stream_s, 0.5), "stream_p99_s": _pct(t.stream_s, 0.99)}
    rows, itl = per_minute(t.records, res["samples"], res["ran_s"])
    st = steady(rows, itl, warmup, res["load_s"])
    return summary, rows, st


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = _parser().parse_args(argv)
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model, env=started_stack_env(args, args.clients))
    try:
        lanes = stack.health()["pool"]["total_slots"]  # request slots: how many requests run at once
        clients = args.clients or 4 * lanes
        duration = args.duration
        if args.end_by is not None:  # a slow start-up shortens the load, not the caller's time limit
            duration = max(1.0, min(duration, args.end_by - (time.monotonic() - started)))
        load_before = machine_load()
        res = asyncio.run(soak(stack, duration, clients, args.seed, args.mix, args.max_prompt, args.late_s))
    finally:
        stack.down()
    t: Tally = res["tally"]
    summary, rows, st = summarize(res, args.warmup_minutes)
    rss = _rss_series(res["samples"])
    memory = {name: _drift(points, duration) for name, points in rss.items()}  # samples span it
    summary["max_memory_change"] = max((abs(m.get("change", 0)) for m in memory.values()), default=0)
    summary["steady"] = st
    summary["done_when"] = done_when(summary, st)
    out = {"bench": "soak", "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "mix": args.mix, "device": args.device, "model": res["model"], "window": res["window"],
           "random_weights": args.random_weights, "max_prompt": args.max_prompt, "attached": bool(args.state_dir),
           "tp": args.tp, "lanes": lanes, "clients": clients, "seed": args.seed, "duration_s": duration,
           "warmup_minutes": args.warmup_minutes, "summary": summary, "minutes": rows,
           "by_kind": by_kind(t.records), "refusals": dict(t.refusals.most_common()),
           "long_prompt": _long(t.records), "turns": _turns(t.records),
           "images": res["images"], "image_note": res["image_note"],
           "outcomes": dict(t.outcomes), "codes": dict(sorted(t.codes.items())), "memory": memory,
           "rss_samples": rss, "lost_examples": t.lost[:20],
           "load_before": load_before, "load_after": machine_load()}
    print(json.dumps({k: v for k, v in summary.items() if k != "steady"}))
    write_results(args.out, "soak", out, markdown(out))
    return 0 if passed(summary, args.mix) else 1


def passed(summary: dict, mix: str) -> bool:
    """The default mix: nothing lost, no restart, the pool empty at the end, RSS within 5% over the run. The GPU
    mix: issue 54's Done-when on top (the checks the run could make)."""
    ok = summary["lost"] == 0 and summary["restarts"] == 0 and summary["kv_cache_usage_perc_end"] == 0
    if mix != "gpu":
        return ok and summary["max_memory_change"] <= 0.05
    return ok and all(v is not False for v in summary["done_when"].values())


def _parser() -> argparse.ArgumentParser:
    ap = flags.parser("bench.soak", __doc__)
    add_stack_args(ap)
    add_started_stack_args(ap)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    ap.add_argument("--end-by", type=float, default=None,
                    help="stop the load at the latest this many seconds after the bench started, start-up included "
                         "(a time-limited call: a slow start shortens the load instead of overrunning)")
    ap.add_argument("--late-s", type=float, default=120.0,
                    help="seconds a request may still run after the load stopped; then it is lost (a hang), and the "
                         "run ends (default 120)")
    ap.add_argument("--clients", type=int, default=None, help="concurrent clients (default 4 x the lanes)")
    ap.add_argument("--mix", choices=("default", "gpu"), default="default",
                    help="default: short / medium / long prompts inside the window; gpu: issue 54's GPU soak mix")
    ap.add_argument("--max-prompt", type=int, default=None,
                    help="--mix gpu: cap prompt lengths at this many tokens (a tiny model's window; the 200k "
                         "prompt stays, to be refused)")
    ap.add_argument("--warmup-minutes", type=int, default=1,
                    help="minutes left out of the steady figures (drifts, ITL ratio) (default 1)")
    flags.add(ap, flags.SEED, "seed of the request mix (default 7)", default="7")
    flags.add(ap, flags.OUT, "directory for soak-<time>.json and .md (default: print only)")
    return ap


# ------------------------------------------------------------------------------------------------ markdown


def _cell(v: object, fmt: str = "{}") -> str:
    return "—" if v is None else fmt.format(v)


def _codes(refused: dict) -> str:
    return ", ".join(f"{k} × {v}" for k, v in refused.items()) or "0"


def _mix_line(r: dict) -> str:
    if r["mix"] == "gpu":
        cap = f", capped at {r['max_prompt']:,} tokens" if r.get("max_prompt") else ""
        images = {True: "images read", False: f"images refused ({r.get('image_note') or '400'}): none sent after",
                  None: "no image answered"}[r.get("images")]
        return ("GPU mix: prompts 100 to 32k tokens (log-uniform buckets 4:3:2:1" + cap + ") and one of 200,000 "
                "sent first; half streamed; 10% cut by the client; n = 2, logprobs, a function tool or a json_schema "
                f"with a thinking budget on some; multi-turn conversations; {images}.")
    return ("prompts short / medium / long (6:3:1), half streamed, 10% cut by the client (streams cancelled after 3 "
            "chunks, others disconnected).")


def _minute_tables(r: dict) -> list[str]:
    lines = ["", "Per minute (requests by the minute they ended, `sent` by the minute they started; memory and pool "
             "from the 10 s samples):", "",
             "| minute | sent | answered | refused | cut | lost | 5xx | TTFT p50 / p99 s | ITL p50 / p99 ms | "
             "GPU MiB | pool use mean / max | running / waiting max | preemptions |",
             "|---:|---:|---:|---|---:|---:|---:|---|---|---:|---|---|---:|"]
    for m in r["minutes"]:
        lines.append(
            f"| {m['minute']} | {m['sent']} | {m['answered']} | {_codes(m['refused'])} | {m['cut']} | {m['lost']} | "
            f"{m['5xx']} | {_cell(m['ttft_p50_s'])} / {_cell(m['ttft_p99_s'])} | {_cell(m['itl_p50_ms'])} / "
            f"{_cell(m['itl_p99_ms'])} | {_cell(m['gpu_mib'])} | {_cell(m['kv_usage_mean'], '{:.2%}')} / "
            f"{_cell(m['kv_usage_max'], '{:.2%}')} | {_cell(m['running_max'], '{:.0f}')} / "
            f"{_cell(m['waiting_max'], '{:.0f}')} | {_cell(m['preemptions'], '{:.0f}')} |")
    names = sorted({n for m in r["minutes"] for n in m["rss_mb"]})
    lines += ["", "Host RSS per process per minute (MB, mean of the samples):", "",
              "| minute | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    lines += [f"| {m['minute']} | " + " | ".join(_cell(m["rss_mb"].get(n)) for n in names) + " |"
              for m in r["minutes"]]
    return lines


def _steady_lines(r: dict) -> list[str]:
    s = r["summary"]
    st, dw = s["steady"], s["done_when"]
    rss = st["rss_drift"]
    worst = max(rss, key=lambda n: abs(rss[n])) if rss else None

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v * 100:+.2f}%"

    def verdict(v: bool | None) -> str:
        return {True: "yes", False: "**no**", None: "not measured"}[v]

    return ["", f"Steady minutes (after {r['warmup_minutes']} of warm-up): {st['minutes'] or 'none'}.", "",
            f"- lost: {s['lost']}, 5xx: {s['5xx']} (0 each: {verdict(dw['lost'] and dw['5xx'])})",
            f"- GPU memory drift, first steady minute to the last: {pct(st['gpu_memory_drift'])} "
            f"(<= 1%: {verdict(dw['gpu_memory_flat'])})",
            f"- host RSS drift, worst process: {worst or '—'} {pct(rss.get(worst) if worst else None)} "
            f"(<= 3%: {verdict(dw['rss_flat'])}); all: "
            + (", ".join(f"{n} {pct(v)}" for n, v in rss.items()) or "—"),
            f"- ITL in the steady minutes: p50 {_cell(st['itl_p50_ms'])} ms, p99 {_cell(st['itl_p99_ms'])} ms, "
            f"p99 / median {_cell(st['itl_p99_over_median'])} (<= 2.5: {verdict(dw['itl_tail'])})"]


def _gpu_mix_lines(r: dict) -> list[str]:
    lp, turns = r["long_prompt"], r["turns"]
    lines = ["", "| kind | sent | answered | refused | cut | lost |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {k} | {c.get('sent', 0)} | {c.get('answered', 0)} | {c.get('refused', 0)} | {c.get('cut', 0)} | "
              f"{c.get('lost', 0)} |" for k, c in r["by_kind"].items()]
    if lp:
        lines += ["", f"The 200,000-token prompt: {lp['outcome']} (HTTP {lp['code']}) after {lp['seconds']} s"
                  + (f" ({lp['message'].rstrip('.')})" if lp["message"] else "") + "."]
    lines.append(f"Conversation turns after the first answered with usage: {turns['answered_with_usage']}, "
                 f"{turns['with_cache_hit']} with prefix-cache hits ({turns['cached_tokens']:,} cached tokens).")
    if r["refusals"]:
        lines.append("Refusals by code: " + ", ".join(f"{k} × {v}" for k, v in r["refusals"].items()) + ".")
    return lines


def markdown(r: dict) -> str:
    s = r["summary"]
    device = f"{r['device']}" + (f", random weights {r['random_weights']}" if r.get("random_weights") else "")
    who = f"{r['clients']} clients" + (" (4 x {} lanes)".format(r["lanes"]) if r["clients"] == 4 * r["lanes"] else "")
    lines = [f"# Soak bench {r['when']}", "",
             f"{r['duration_s']:.0f} s of load ({s['duration_s']:.0f} s until the last request ended), {who} "
             f"against `twinspark up` (" + ("attached" if r["attached"] else f"TP {r['tp']}") + f", {device}, model "
             f"{r['model']}, window {r['window']:,} tokens): {_mix_line(r)}", "",
             "| requests | replies | refused | cancelled | disconnected | lost | 5xx | restarts | kv usage at end |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
             f"| {s['requests']} | {s['replies']} | {_codes(s['refused'])} | {s['cancelled']} | "
             f"{s['disconnected']} | {s['lost']} | {s['5xx']} | {s['restarts']} | {s['kv_cache_usage_perc_end']} |",
             "",
             f"Latency (s): non-streamed replies p50 {s['latency_p50_s']} / p99 {s['latency_p99_s']}; streams "
             f"time to first token p50 {s['ttft_p50_s']} / p99 {s['ttft_p99_s']}, whole stream p50 "
             f"{s['stream_p50_s']} / p99 {s['stream_p99_s']}. HTTP codes: "
             f"{', '.join(f'{k}: {v}' for k, v in r['codes'].items())}."]
    if r["mix"] == "gpu":
        lines += _gpu_mix_lines(r)
    lines += _minute_tables(r)
    if all(m["preemptions"] is None for m in r["minutes"]):
        lines += ["", "Preemptions: the gateway's /metrics has no `num_preemptions` (the scheduler reserves a "
                  "request's whole KV when it admits it and never preempts: services/scheduler/pool.py)."]
    lines += _steady_lines(r)
    lines += ["", "| process | RSS first window (MB) | RSS last window (MB) | change |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v.get('first_mb')} | {v.get('last_mb')} | {v.get('change', 0) * 100:+.1f}% |"
              for k, v in r["memory"].items()]
    lines += ["", load_line(r["load_before"], r["load_after"])]
    if r["lost_examples"]:
        lines += ["", "Lost requests (first ones): " + "; ".join(r["lost_examples"][:5])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
