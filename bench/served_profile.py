"""torch.profiler over served rounds that hold prompt chunks: where a served request's first token goes.

A served prompt round of the whole model took ~1 s for 128 tokens (whole_model-20261204-134632), far
more than its share of an offline prefill; the rank's round stats say how long, not why. This bench starts a stack
with the rank's round profiler on (services/rank_worker/round_profiler.py), sends identical batches of `concurrency`
requests (`prompt-len` random token ids, `output-len` tokens out, greedy), and profiles a window of rounds placed
inside the measured batches: `warm` untimed batches first (compiles, graph captures), then `batches` more; a batch
runs about `output-len` rounds (one prompt round, then decode rounds; the scheduler may split the prompts over
more), so the window skips the warm-up batches and one more batch, and spans two batches' worth of rounds.

    python -m bench.served_profile --model /tmp/wm-4 --random-weights exl3:2.5+fp8 --out $OUT

Writes served_profile-<time>.md / .json (per-batch TTFT and inter-token time, rank 0's round-stats lines with the
prompt rounds' own summary and kernel compiles, the profile's head line), served_profile-<time>-rank0.log (the
rank's log: compile warnings name the kernels) and rank0-rounds.txt / .json beside them (operator tables by GPU
and CPU time; a Chrome trace for `python -m bench.trace_gaps`). `--profile-kind python` profiles the same window
with cProfile: the rank's Python functions by own and cumulative time, when the host sets the rounds' pace.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
import time
from pathlib import Path

from bench import flags
from bench.output import stamp, write_results
from bench.served_load import completion_bodies, level, summarize
from bench.stack import attach_or_start, round_stats
from services.common import shared_flags as shared

STATS_INTERVAL_S = 0.5


def profile_window(warm: int, output_len: int) -> tuple[int, int]:
    """(rounds to skip, rounds to profile): past the warm-up batches and one measured batch, two batches long."""
    return (warm + 1) * output_len, 2 * output_len


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.served_profile", __doc__)
    flags.add(ap, shared.MODEL, "a directory written by `python -m bench.whole_model --write-dir`", type=Path,
              required=True)
    flags.add(ap, shared.RANDOM_WEIGHTS, "recipe (default exl3:2.5+fp8; '' = the checkpoint's own weights)",
              default="exl3:2.5+fp8")
    flags.add(ap, flags.RANKS_DEVICE, "the ranks' device (default cuda; cpu: a smoke test)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests per batch, sent at once (default 8)")
    flags.add(ap, flags.PROMPT_LEN, default="128")
    flags.add(ap, flags.OUTPUT_LEN, default="8")
    ap.add_argument("--warm", type=int, default=3, help="untimed batches first (default 3)")
    ap.add_argument("--batches", type=int, default=6, help="measured batches (default 6; at least 4)")
    ap.add_argument("--profile-kind", choices=("torch", "python"), default="torch",
                    help="torch.profiler's operator tables and trace (default), or cProfile's Python functions: where "
                    "the host's time per round goes (TWINSPARK_PROFILE_KIND)")
    flags.add(ap, flags.OUT, "folder for the results and the rank's profile", required=True)
    args = ap.parse_args(argv)
    if args.batches < 4:
        ap.error("--batches must be at least 4: the profiled window sits inside the measured batches")
    skip, count = profile_window(args.warm, args.output_len)
    prof_dir = args.out  # the rank writes rank0-rounds.txt / .json there
    env = {"TWINSPARK_DEVICE": args.device, "TWINSPARK_DRAFTER": "none",
           **({"TWINSPARK_RANDOM_WEIGHTS": args.random_weights} if args.random_weights else {}),
           "TWINSPARK_STATS_INTERVAL": str(STATS_INTERVAL_S), "TWINSPARK_TORCH_PROFILER_DIR": str(prof_dir),
           "TWINSPARK_PROFILE_ROUNDS": f"{skip}:{count}", "TWINSPARK_PROFILE_KIND": args.profile_kind}
    data: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": str(args.model),
                  "recipe": args.random_weights, "concurrency": args.concurrency, "prompt_len": args.prompt_len,
                  "output_len": args.output_len, "profiled_rounds": [skip + 1, skip + count], "batches": [],
                  "profile_head": "not written yet"}
    at = stamp()

    def save() -> None:  # after each step, so a run cut short (a call's time limit) keeps what it measured
        write_results(args.out, "served_profile", data, markdown(data), at=at)

    t0 = time.perf_counter()
    stack = attach_or_start(None, tp=1, model=str(args.model), env=env)
    data["ready_s"] = round(time.perf_counter() - t0, 1)
    save()
    try:
        url = stack.url + "/v1"
        log = stack.state_dir / "logs" / "rank0.log"
        for b in range(args.warm + args.batches):
            # a new seed a batch: no prefix hits
            bodies = completion_bodies([args.prompt_len] * args.concurrency, args.output_len, random.Random(1000 + b),
                                       draft=False)
            seen = log.stat().st_size
            samples, wall = asyncio.run(level(url, bodies, args.concurrency))
            s = summarize(samples, wall, args.prompt_len)
            if b >= args.warm:
                data["batches"].append({"wall_s": wall, "ttft": s["ttft"], "itl": s["itl"], "errors": s["errors"],
                                        "rank_stats": round_stats(log, seen)})
                save()
            print(f"batch {b}{' (warm-up)' if b < args.warm else ''}: {s['completed']}/{s['requests']} ok in "
                  f"{wall:.2f} s, TTFT median {s['ttft'].get('median_ms', float('nan')):.0f} ms", flush=True)
        time.sleep(2 * STATS_INTERVAL_S)
    finally:
        stack.down()
        rank_log = stack.state_dir / "logs" / "rank0.log"
        if rank_log.exists():  # with the compile warnings (services/rank_worker/compile_watch.py)
            shutil.copy(rank_log, args.out / f"served_profile-{at}-rank0.log")
    head = (prof_dir / "rank0-rounds.txt").read_text().splitlines()[0] if (prof_dir / "rank0-rounds.txt").exists() \
        else "no profile was written (fewer rounds than the window?)"
    data["profile_head"] = head
    save()
    print(markdown(data))
    return 0


def markdown(data: dict) -> str:
    lines = [f"# served profile — {data['date']}", "",
             f"- {data['model']}, {data['recipe']}, TP 1, drafter off; ready in {data.get('ready_s', '?')} s; "
             f"batches of {data['concurrency']} requests sent at once, {data['prompt_len']} random prompt ids, "
             f"{data['output_len']} tokens out, greedy", f"- profiled rounds {data['profiled_rounds'][0]}.."
             f"{data['profiled_rounds'][1]} (rank0-rounds.txt / .json): {data['profile_head']}", "",
             "| batch | wall s | TTFT median / p99 ms | ITL median ms |", "|---:|---:|---|---:|"]
    for i, b in enumerate(data["batches"]):
        lines.append(f"| {i} | {b['wall_s']:.2f} | {b['ttft'].get('median_ms', 0):.0f} / "
                     f"{b['ttft'].get('p99_ms', 0):.0f} | {b['itl'].get('median_ms', 0):.2f} |")
    lines += ["", "Rank 0's round stats per batch:", ""]
    for i, b in enumerate(data["batches"]):
        lines += [f"- batch {i}:", *(f"  - {x}" for x in b["rank_stats"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
