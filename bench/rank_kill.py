"""A rank killed mid-load: what the users of a stack see when one of its ranks dies (`kill -9`) while streams are in
flight, and how the stack comes back (issue "the whole model under load on a GPU", item 2).

Steps: greedy replies to a few prompts (the ids to match later); `--streams` long greedy streams started and
flowing; SIGKILL to one rank; every stream must end with an error within `--bound-s` (the peer watch's bound), a
request sent during the outage must get a 503, `/health` must name the rank; then the supervisor restarts the
rank group, the time until `/health` is 200 again is measured, and the same prompts must give the same ids.

    python -m bench.rank_kill --device cuda --tp 1 --model DIR --random-weights exl3:2.5+fp8 --out $OUT
    python -m bench.rank_kill --tp 2 --streams 4                 # the tiny model on the CPU

Writes rank_kill-<time>.json and .md; exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from bench import flags
from bench.output import stamp, write_results
from bench.stack import Stack, add_stack_args, add_started_stack_args, attach_or_start, started_stack_env

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18], [101, 7, 33, 250, 9], [42] * 12, [5, 6, 7, 8, 9, 10, 11]]


@dataclass
class StreamEnd:
    """How one in-flight stream ended, seconds after the kill."""
    chunks: int = 0
    kind: str = "running"  # error (an SSE error event or a non-200 status), cut (closed without [DONE]), done
    message: str = ""
    after_kill_s: float | None = None


def greedy_ids(url: str, prompt: list[int], tokens: int) -> list[int]:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


class Stream(threading.Thread):
    """One long greedy stream; `flowing` is set after its third chunk (or when it ends)."""

    def __init__(self, url: str, prompt: list[int], tokens: int, killed_at: list[float]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.tokens, self.killed_at = url, prompt, tokens, killed_at
        self.flowing = threading.Event()
        self.end = StreamEnd()

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    self._ended("error", f"HTTP {r.status_code}")
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self._ended("done", "")
                        return
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self._ended("error", str(obj["error"].get("message", obj["error"]))[:200])
                        return
                    self.end.chunks += 1
                    if self.end.chunks >= 3:
                        self.flowing.set()
            self._ended("cut", "closed without [DONE]")
        except httpx.HTTPError as exc:
            self._ended("cut", repr(exc)[:200])

    def _ended(self, kind: str, message: str) -> None:
        self.end.kind, self.end.message = kind, message
        if self.killed_at:
            self.end.after_kill_s = time.monotonic() - self.killed_at[0]
        self.flowing.set()


def wait_for(check, timeout: float, step: float = 0.1) -> bool:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            if check():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(step)
    return False


def run(stack: Stack, rank: str, streams: int, tokens: int, stream_tokens: int, bound_s: float, recovery_s: float
        ) -> dict:
    url = stack.url
    before = [greedy_ids(url, p, tokens) for p in PROMPTS]
    killed_at: list[float] = []
    running = [Stream(url, [3 + i, 60 + i, 7, 9, 11], stream_tokens, killed_at) for i in range(streams)]
    for s in running:
        s.start()
    flowing = all(s.flowing.wait(300) for s in running) and all(s.end.kind == "running" for s in running)
    victim = stack.processes()[rank]
    restarts_before = stack.restarts()
    killed_at.append(time.monotonic())
    os.kill(victim, signal.SIGKILL)
    named = wait_for(lambda: rank in httpx.get(url + "/health", timeout=5).json().get("down", []), bound_s, 0.05)
    for s in running:
        s.join(max(0.0, bound_s - (time.monotonic() - killed_at[0])))
    outage = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30).status_code
    healthy = wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, recovery_s, 0.5)
    healthy_s = time.monotonic() - killed_at[0]
    after = [greedy_ids(url, p, tokens) for p in PROMPTS] if healthy else []
    ends = [s.end.__dict__ for s in running]
    in_bound = [e for e in ends if e["kind"] == "error" and e["after_kill_s"] is not None
                and e["after_kill_s"] <= bound_s]
    return {"rank": rank, "streams": streams, "flowing_before_kill": flowing, "stream_ends": ends,
            "errors_within_bound": len(in_bound), "bound_s": bound_s, "health_named_rank": named,
            "outage_status": outage, "healthy_again": healthy, "time_to_healthy_s": round(healthy_s, 1),
            "restarts": {"before": restarts_before, "after": stack.restarts()},
            "same_ids": sum(a == b for a, b in zip(before, after)), "prompts": len(PROMPTS),
            "ok": bool(flowing and len(in_bound) == streams and named and outage == 503 and healthy
                       and after == before)}


def markdown(r: dict) -> str:
    late = [e for e in r["stream_ends"] if not (e["kind"] == "error" and (e["after_kill_s"] or 1e9) <= r["bound_s"])]
    slowest = max(((e["after_kill_s"] or 0.0) for e in r["stream_ends"]), default=0.0)
    lines = [f"# rank killed mid-load — {r['date']}", "",
             f"- stack: {r['stack']}", f"- SIGKILL to {r['rank']} with {r['streams']} greedy streams flowing", "",
             "| check | result |", "|---|---|",
             f"| streams ended with an error within {r['bound_s']:g} s | {r['errors_within_bound']}/{r['streams']} |",
             f"| slowest stream end after the kill | {slowest:.2f} s |",
             f"| /health named {r['rank']} within {r['bound_s']:g} s | {r['health_named_rank']} |",
             f"| a request during the outage | HTTP {r['outage_status']} |",
             f"| healthy again after the kill | {r['time_to_healthy_s']} s ({'yes' if r['healthy_again'] else 'no'}) |",
             f"| restarts before / after | {r['restarts']['before']} / {r['restarts']['after']} |",
             f"| replies after recovery = before | {r['same_ids']}/{r['prompts']} |", "",
             f"Verdict: {'ok' if r['ok'] else 'FAILED'}."]
    if late:
        lines += ["", "Streams not ended with an error within the bound:", "", *(f"- {e}" for e in late)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.rank_kill", __doc__)
    add_stack_args(ap)
    add_started_stack_args(ap)
    ap.add_argument("--rank", default=None, help="the role to kill (default: the last rank, rankN-1)")
    ap.add_argument("--streams", type=int, default=8, help="greedy streams in flight at the kill (default 8)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per compared reply (default 32)")
    ap.add_argument("--stream-tokens", type=int, default=4096,
                    help="max_tokens of each in-flight stream: long enough to outlast the kill (default 4096)")
    ap.add_argument("--bound-s", type=float, default=5.0, help="seconds every stream has to end (default 5)")
    ap.add_argument("--recovery-s", type=float, default=600.0,
                    help="seconds the stack has to be healthy again (default 600: a CUDA rank reloads its weights)")
    flags.add(ap, flags.OUT, "directory for rank_kill-<time>.json and .md (default: print only)")
    args = ap.parse_args(argv)
    stack = attach_or_start(args.state_dir, tp=args.tp, model=args.model,
                            env=started_stack_env(args, args.streams))
    try:
        rank = args.rank or f"rank{int(stack.up_json().get('tp', args.tp)) - 1}"
        r = run(stack, rank, args.streams, args.tokens, args.stream_tokens, args.bound_s, args.recovery_s)
    finally:
        stack.down()
    r.update(date=time.strftime("%Y-%m-%dT%H:%M:%S"),
             stack=f"TP {args.tp}, {args.device}, {args.random_weights or 'checkpoint'} weights, model {args.model}")
    md = markdown(r)
    print(md)
    write_results(args.out, "rank_kill", r, md, at=stamp())
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
