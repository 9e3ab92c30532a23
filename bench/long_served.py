"""One long prompt served through HTTP beside a stream that is already decoding: the prompt's TTFT through
`/v1/completions` on `twinspark up` (random weights, drafts off), and the running stream's inter-token gaps before
and during that prefill (p50 / p99 / longest) — the step budget's trade-off (`--max-num-batched-tokens`) between a
long prompt's TTFT and the other streams' inter-token time, seen where users meet it. Rank 0's round stats over the
prefill (a line every 2 s) give its longest prompt round, so the stream's longest gap can be read against one step.

The model is bench/long_context.py's (random weights at the release's dimensions, `--layers` layers: 4 = 3 KDA + 1
MLA/DSA, 1 dense FFN + 3 MoE). With --offline (default on a GPU), long_context.py then prefills the same length on the
same machine (the stack down first: one model on the GPU at a time), in chunks of the budget and with the ranks'
virtual shards, and the table gives the ratio.

    python -m bench.long_served --out $OUT                    # 1,040,000 tokens, bf16 weights, on a GPU
    python -m bench.long_served --tiny --length 2048 --budget 256 --device cpu   # smoke test on make-tiny dims

Writes long_served-<time>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench import flags
from bench.output import RESULTS, write_results
from bench.random_weights import bench_spec
from bench.stack import attach_or_start, round_stats
from bench.stats import percentile

LENGTH = 1_040_000
STATS_INTERVAL_S = 2.0
# A round-stats line's prompt rounds (services/rank_worker/round_stats.py): GPU time (CUDA only) and host launch, most.
_PROMPT_ROUNDS = re.compile(r"with prompt rows: (?:GPU p50 [\d.]+ / max ([\d.]+) ms, )?host launch p50 [\d.]+ / max "
                            r"([\d.]+) ms")


class DecodeStream(threading.Thread):
    """A streamed completion that keeps decoding (ignore_eos) until stopped; records when each chunk came."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.arrivals: list[float] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        # return_token_ids: a chunk per round even when its ids decode to no text (a random-weight model over a
        # small tokenizer emits many such ids), so the arrivals are the stream's token times
        body = {"prompt": [random.Random(1).randrange(5, 1000) for _ in range(128)], "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True, "draft": False, "return_token_ids": True}
        try:
            with httpx.stream("POST", self.url + "/completions", json=body, timeout=None) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read().decode()[:300]}"
                    return
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.arrivals.append(time.perf_counter())
                    if self.stop.is_set():
                        return  # closing the stream aborts the request on the server
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            self.error = f"{type(exc).__name__}: {exc}"


def gap_stats(arrivals: list[float], start: float, end: float) -> dict:
    """Inter-chunk gaps of the chunks that arrived in [start, end], in ms."""
    times = [t for t in arrivals if start <= t <= end]
    gaps = sorted((b - a) * 1e3 for a, b in zip(times, times[1:]))
    if not gaps:
        return {"chunks": len(times)}
    return {"chunks": len(times), "p50_ms": round(statistics.median(gaps), 2),
            "p99_ms": round(percentile(gaps, 0.99), 2), "max_ms": round(gaps[-1], 2)}


def longest_prompt_round(lines: list[str]) -> dict:
    """The longest prompt round in round-stats lines: its GPU time (None on the CPU) and host launch, in ms."""
    found = [m.groups() for m in map(_PROMPT_ROUNDS.search, lines) if m]
    gpu = [float(g) for g, _ in found if g is not None]
    launch = [float(h) for _, h in found]
    return {"gpu_max_ms": max(gpu) if gpu else None, "launch_max_ms": max(launch) if launch else None}


def long_ttft(url: str, length: int, seed: int) -> dict:
    """TTFT and status of one streamed `length`-token prompt with one output token."""
    rng = random.Random(seed)
    body = {"prompt": [rng.randrange(5, 1000) for _ in range(length)], "max_tokens": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "draft": False}
    t0 = time.perf_counter()
    first = None
    usage = None
    with httpx.stream("POST", url + "/completions", json=body, timeout=None) as r:
        status = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return {"status": status, "start": t0, "first": first, "ttft_s": None if first is None else first - t0,
            "usage": usage}


def offline_ttft(args: argparse.Namespace, out: Path) -> float | None:
    """bench/long_context.py's TTFT for the same length and layers, chunks of the budget."""
    cmd = [sys.executable, "-m", "bench.long_context", "--lengths", str(args.length), "--chunk", str(args.budget),
           "--layers", str(args.layers), "--virtual", str(args.virtual), "--out", str(out), "--name",
           "long_served-offline"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-2000:], proc.stderr[-2000:], flush=True)
    path = out / "long_served-offline.json"
    if proc.returncode != 0 or not path.exists():
        return None
    rows = json.loads(path.read_text()).get("prefill", [])
    return next((r.get("ttft_s") for r in rows if r.get("tokens") == args.length), None)


def model_dir(layers: int, tiny: bool) -> Path:
    """long_context.py's model (bench_spec) as a checkpoint dir without weights: config and make-tiny's tokenizer."""
    from model.checkpoint import write_model_files
    from model.checkpoint.tokenizer_builder import build_tokenizer
    out = Path(tempfile.mkdtemp(prefix="long-served-model-"))
    write_model_files(out, bench_spec(layers=layers, tiny=tiny), build_tokenizer(), dtype="bfloat16")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.long_served", __doc__)
    flags.add(ap, flags.LAYERS)
    flags.add(ap, flags.TINY, "make-tiny dimensions: a CPU smoke test of this script")
    flags.add(ap, flags.VIRTUAL, "the ranks' virtual shards (default 4, serve-rank's)", default="4")
    ap.add_argument("--length", type=int, default=LENGTH, help=f"prompt tokens (default {LENGTH:,})")
    ap.add_argument("--stream-tokens", type=int, default=16384,
                    help="max_tokens of the decoding stream (it is stopped once the long prompt's token came)")
    ap.add_argument("--budget", type=int, default=8192, help="--max-num-batched-tokens of the stack (default 8192)")
    ap.add_argument("--weights", default="bf16", help="--random-weights of the stack (default bf16, as long_context)")
    flags.add(ap, flags.RANKS_DEVICE)
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=None,
                    help="also run bench/long_context.py at the same length (default: on a GPU)")
    flags.add(ap, flags.OUT, default=str(RESULTS))
    args = ap.parse_args(argv)
    offline = args.offline if args.offline is not None else args.device == "cuda"
    model = model_dir(args.layers, args.tiny)
    env = {"TWINSPARK_DEVICE": args.device, "TWINSPARK_VIRTUAL_SHARDS": str(args.virtual),
           "TWINSPARK_RANDOM_WEIGHTS": args.weights, "TWINSPARK_DRAFTER": "none",
           "TWINSPARK_MAX_NUM_BATCHED_TOKENS": str(args.budget), "TWINSPARK_STATS_INTERVAL": str(STATS_INTERVAL_S)}
    t0 = time.perf_counter()
    stack = attach_or_start(None, tp=1, model=str(model), env=env)
    result: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"), "args": {k: str(v) for k, v in
                                                                                       vars(args).items()},
                    "ready_s": round(time.perf_counter() - t0, 1)}
    print(f"stack ready in {result['ready_s']} s", flush=True)
    try:
        url = stack.url + "/v1"
        # Warm-up, untimed for the figures: a prompt of two budget-sized chunks and a short decode compile what the
        # measured requests run (another seed: no prefix in common). Its wall time is a cold server's first cost.
        w0 = time.perf_counter()
        long_ttft(url, 2 * args.budget, seed=3)
        result["warmup_s"] = round(time.perf_counter() - w0, 1)
        stream = DecodeStream(url, max_tokens=args.stream_tokens)
        stream.start()
        while len(stream.arrivals) < 200 and stream.is_alive():
            time.sleep(0.05)
        log = stack.state_dir / "logs" / "rank0.log"
        seen = log.stat().st_size
        long = long_ttft(url, args.length, seed=2)
        time.sleep(STATS_INTERVAL_S + 0.5)  # the stream's rounds go on: the window holding the last chunk is logged
        stream.stop.set()
        stream.join(timeout=30)
        before_start = stream.arrivals[0] if stream.arrivals else long["start"]
        result.update(long={k: v for k, v in long.items() if k not in ("start", "first")},
                      stream_error=stream.error,
                      gaps_before=gap_stats(stream.arrivals, before_start, long["start"]),
                      gaps_during=gap_stats(stream.arrivals, long["start"], long["first"] or long["start"]),
                      rank_stats=round_stats(log, seen))
        result["longest_prompt_round"] = longest_prompt_round(result["rank_stats"])
        print(json.dumps(result, indent=1), flush=True)
    finally:
        stack.down()
    if offline:
        result["offline_ttft_s"] = offline_ttft(args, args.out)
        served = result["long"].get("ttft_s")
        if served and result["offline_ttft_s"]:
            result["served_over_offline"] = round(served / result["offline_ttft_s"], 3)
    write(result, args.out)
    return 0 if result["long"].get("status") == 200 else 1


def write(result: dict, out: Path) -> None:
    a, long = result["args"], result["long"]
    b, d = result.get("gaps_before", {}), result.get("gaps_during", {})
    lines = [f"# long prompt served — {result['date']}", "",
             f"- long_context.py's model: {a['layers']} layers{' (make-tiny dims)' if a['tiny'] == 'True' else ''}, random {a['weights']} weights on {a['device']}, TP 1, drafts off, "
             f"{a['virtual']} virtual shards, `--max-num-batched-tokens {a['budget']}`; one streamed completion of {int(a['length']):,} random "
             "token ids (1 token out) sent while one 128-token stream was decoding", "",
             "| TTFT s | offline TTFT s | served / offline | stream gaps before: p50 / p99 / max ms | during the "
             "prefill: p50 / p99 / max ms | chunks during | usage |", "|---:|---:|---:|---|---|---:|---|",
             f"| {_f(long.get('ttft_s'))} | {_f(result.get('offline_ttft_s'))} | {result.get('served_over_offline', '')}"
             f" | {b.get('p50_ms')} / {b.get('p99_ms')} / {b.get('max_ms')} | {d.get('p50_ms')} / {d.get('p99_ms')}"
             f" / {d.get('max_ms')} | {d.get('chunks')} | {long.get('usage')} |"]
    if result.get("stream_error"):
        lines += ["", f"The decoding stream ended with: {result['stream_error']}"]
    lr = result.get("longest_prompt_round") or {}
    if lr.get("launch_max_ms") is not None:
        step = max(x for x in (lr.get("gpu_max_ms"), lr["launch_max_ms"]) if x is not None)
        ratio = f"; the stream's longest gap during the prefill is {d['max_ms'] / step:.2f}x that" \
            if d.get("max_ms") else ""
        gpu = f"GPU {_f(lr['gpu_max_ms'])} ms, " if lr.get("gpu_max_ms") is not None else ""
        lines += ["", f"Longest prompt round during the prefill (rank 0's round stats): {gpu}host launch "
                  f"{_f(lr['launch_max_ms'])} ms{ratio}."]
    if result.get("rank_stats"):
        lines += ["", f"Rank 0's round stats from the long prompt's arrival (a line per {STATS_INTERVAL_S:g} s):", "",
                  *(f"- {x}" for x in result["rank_stats"])]
    path = write_results(out, "long_served", result, "\n".join(lines) + "\n")
    print(f"wrote {path} and .md", flush=True)


def _f(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
