"""What a cold server costs its first users: `twinspark up` from cold (its ready time, which includes the ranks'
warm-up on a GPU), then a fixed mix of 12 completions (prompts of 16 to ~1,800 random token ids, 32 tokens out) sent
one by one right after ready — the first pass — and the same mix again with other token ids of the same lengths
(no prefix-cache hits) — the second pass. First / second is the cost of what still compiles on the request path.
Then the stack is stopped and started again: its ready time with a warm kernel cache (Triton's cache dir).

    python -m bench.whole_model --write-dir /tmp/m4 --layers 4
    python -m bench.cold_start --model /tmp/m4 --random-weights w4a16+bf16 --out $OUT
    python -m bench.cold_start --device cpu --out /tmp/cs        # the tiny default model on the CPU (smoke test)

Writes cold_start-<time>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import level
from bench.stack import attach_or_start

# Prompt lengths of the mix (the 12 mixed requests, prompts up to ~1,800 tokens): short chats, a few
# paragraphs, a document; none on the 16-row grid twice in a row, as real prompts are not.
MIX = (16, 37, 100, 130, 257, 400, 515, 700, 1023, 1200, 1500, 1800)


def bodies(seed: int, output_len: int, vocab: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(5, vocab) for _ in range(n)], "max_tokens": output_len, "ignore_eos": True,
             "temperature": 0, "stream": True, "draft": False} for n in MIX]


def one_pass(url: str, seed: int, output_len: int, vocab: int) -> dict:
    """The mix sent one request at a time: wall seconds, and per request TTFT and completion."""
    per = []
    t0 = time.perf_counter()
    for body in bodies(seed, output_len, vocab):
        samples, wall = asyncio.run(level(url, [body], 1))
        s = samples[0]
        per.append({"prompt": len(body["prompt"]), "ok": s.ok, "ttft_s": round(s.ttft_s, 3), "wall_s": round(wall, 3),
                    "error": s.error})
    return {"wall_s": round(time.perf_counter() - t0, 2), "ok": sum(p["ok"] for p in per), "requests": per}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cold_start", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or config dir (default: the tiny default model)")
    ap.add_argument("--random-weights", default=None, help="the stack's --random-weights (e.g. w4a16+bf16)")
    ap.add_argument("--device", default="cuda", help="the ranks' device (default cuda)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=32, help="tokens out per request (default 32)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    env = {"TWINSPARK_DEVICE": args.device, "TWINSPARK_DRAFTER": "none",
           **({"TWINSPARK_RANDOM_WEIGHTS": args.random_weights} if args.random_weights else {})}
    vocab = 1000  # ids inside any checkpoint's vocabulary
    result: dict = {"date": dt.datetime.now().isoformat(timespec="seconds"),
                    "args": {k: str(v) for k, v in vars(args).items()}, "mix": list(MIX)}
    for start in ("cold", "warm cache"):
        t0 = time.perf_counter()
        stack = attach_or_start(None, tp=args.tp, model=args.model, env=env)
        ready = round(time.perf_counter() - t0, 1)
        print(f"{start}: ready in {ready} s", flush=True)
        try:
            url = stack.url + "/v1"
            if start == "cold":
                result["ready_cold_s"] = ready
                result["first_pass"] = one_pass(url, seed=1, output_len=args.output_len, vocab=vocab)
                result["second_pass"] = one_pass(url, seed=2, output_len=args.output_len, vocab=vocab)
                first, second = result["first_pass"]["wall_s"], result["second_pass"]["wall_s"]
                result["first_over_second"] = round(first / second, 3) if second else None
                print(f"first pass {first} s, second pass {second} s ({result['first_over_second']}x)", flush=True)
            else:
                result["ready_warm_cache_s"] = ready
        finally:
            stack.down()
    write(result, args.out)
    passes = (result["first_pass"], result["second_pass"])
    return 0 if all(p["ok"] == len(MIX) for p in passes) else 1


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"cold_start-{dt.datetime.now():%Y%m%d-%H%M%S}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    a = result["args"]
    f, s = result["first_pass"], result["second_pass"]
    lines = [f"# cold start — {result['date']}", "",
             f"- `twinspark up --device {a['device']} --tp {a['tp']}`, model {a['model']} (random weights "
             f"{a['random_weights']}), drafter off; 12 streamed completions of {', '.join(map(str, result['mix']))} "
             f"random token ids, {a['output_len']} tokens out each, greedy, sent one at a time right after ready; "
             "the second pass: other ids of the same lengths (no prefix-cache hits)", "",
             "| ready s (cold) | first pass s | second pass s | first / second | ready s (warm kernel cache) | ok |",
             "|---:|---:|---:|---:|---:|---|",
             f"| {result['ready_cold_s']} | {f['wall_s']} | {s['wall_s']} | {result['first_over_second']} | "
             f"{result['ready_warm_cache_s']} | {f['ok']}/12, {s['ok']}/12 |", "",
             "| prompt | TTFT s, first pass | TTFT s, second pass |", "|---:|---:|---:|"]
    lines += [f"| {p['prompt']} | {p['ttft_s']} | {q['ttft_s']} |" for p, q in zip(f["requests"], s["requests"])]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / stem}.json and .md", flush=True)


if __name__ == "__main__":
    sys.exit(main())
