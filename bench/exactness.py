"""Concurrency never changes answers, checked through HTTP against a stack: 12 completions of mixed prompt lengths
(greedy and seeded T=0.8) served one by one (the references), then staggered 50 ms apart, then all at once; the
token ids must match 12/12 each way. tests/gpu/test_served_cuda.py runs it on a started CUDA stack; bench/whole_model
on the 45-layer model.

    python -m bench.exactness --state-dir ~/.local/state/twinspark     # a running stack
    python -m bench.exactness --tp 2 --model DIR                        # one started here

Prints `staggered N/12, burst N/12`; exits 1 when either is short.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.stack import add_stack_args, attach_or_start

N = 12


def requests(n: int = N, seed: int = 99, vocab: int = 1000) -> list[dict]:
    """Mixed prompt lengths (3 .. 300 ids) and output lengths; even ones greedy, odd ones seeded T=0.8."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = {"prompt": [rng.randrange(5, vocab) for _ in range(rng.choice((3, 40, 130, 300)))],
                "max_tokens": rng.randrange(8, 40), "ignore_eos": True, "return_token_ids": True}
        body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 500 + i})
        out.append(body)
    return out


async def concurrent(url: str, bodies: list[dict], stagger_s: float) -> list[list[int]]:
    """Token ids of every body, request i sent i * stagger_s after the first (0: all at once)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int) -> list[int]:
            await asyncio.sleep(i * stagger_s)
            r = await client.post("/completions", json=bodies[i])
            if r.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {r.status_code} {r.text}")
            return r.json()["choices"][0]["token_ids"]
        return list(await asyncio.gather(*(one(i) for i in range(len(bodies)))))


def serial(url: str, bodies: list[dict]) -> list[list[int]]:
    out = []
    for i, b in enumerate(bodies):
        r = httpx.post(url + "/completions", json=b, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {r.status_code} {r.text}")
        out.append(r.json()["choices"][0]["token_ids"])
    return out


@dataclass
class Check:
    serial: list[list[int]]
    staggered_same: int
    burst_same: int

    @property
    def exact(self) -> bool:
        return self.staggered_same == len(self.serial) and self.burst_same == len(self.serial)

    def line(self, label: str) -> str:
        n = len(self.serial)
        return f"{label}: staggered {self.staggered_same}/{n} identical to serial, burst {self.burst_same}/{n}"


def check(url_v1: str, bodies: list[dict] | None = None) -> Check:
    """Serial references, then staggered and burst runs compared with them."""
    bodies = bodies or requests()
    ref = serial(url_v1, bodies)
    staggered = asyncio.run(concurrent(url_v1, bodies, 0.05))
    burst = asyncio.run(concurrent(url_v1, bodies, 0.0))
    return Check(ref, sum(a == b for a, b in zip(staggered, ref)), sum(a == b for a, b in zip(burst, ref)))


def same_requests(mine: list[list[int]], theirs: list[list[int]]) -> int:
    """Requests whose token ids are the same in both runs of the mix (none when the runs are of different mixes)."""
    return sum(a == b for a, b in zip(mine, theirs)) if len(mine) == len(theirs) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.exactness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_args(ap)
    ap.add_argument("--label", default="stack", help="what the printed line calls the stack")
    ap.add_argument("--json", type=Path, default=None, help="also write the counts and the serial token ids here")
    ap.add_argument("--same-as", type=Path, default=None, metavar="JSON",
                    help="another stack's --json (e.g. TP 1's): also compare the serial token ids with its own, "
                         "request by request, and fail unless all are equal")
    args = ap.parse_args(argv)
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model)
    try:
        result = check(stack.url + "/v1")
    finally:
        stack.down()
    print(result.line(args.label), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "staggered_same": result.staggered_same,
                                         "burst_same": result.burst_same, "n": len(result.serial),
                                         "serial_token_ids": result.serial}) + "\n")
    same = True
    if args.same_as:
        other = json.loads(args.same_as.read_text())
        equal = same_requests(result.serial, other["serial_token_ids"])
        same = equal == len(result.serial)
        print(f"{args.label} serial = {other['label']} serial: {equal}/{len(result.serial)} requests, the same "
              f"token ids", flush=True)
    return 0 if result.exact and same else 1


if __name__ == "__main__":
    sys.exit(main())
