"""The admission check of a request's grammar: compiled and walked by the structured-output library (llguidance),
in a child process, under the limits the scheduler's matchers run with (services/common/grammar_limits.py).

Why a child process: the library can take the process down or hold it for long on hostile grammars — a chain of
~1,000 `$ref`s or Lark rules overflows its stack (SIGSEGV), 100,000 choices trip an internal assertion (a panic)
after 16 s, an object of 10,000 optional properties compiles for 10 s. Here a crash is a 400 for that request and a
fresh worker for the next; a check past `DEADLINE_S` of CPU time is refused, and one that has not answered after
`WALL_S` is killed and refused — unless the worker has not yet had `DEADLINE_S` of CPU time (a loaded machine
starved it), which gets up to `STARVED_WALL_S`. A grammar's verdict is kept (`VERDICTS`): a client sends one schema
many times. The worker compiles on a thread with half the usual 8 MiB stack, so what passes here compiles in the
scheduler's main thread with room to spare.

Why a walk: some limits bite only while generating. An object of 3,000 optional properties compiles, then its first
token builds a parser row of 12,007 items (the limit is 2,000); `{"$ref": "#"}` compiles to a grammar that allows
nothing. The worker walks each grammar for `WALK_TOKENS` tokens on `WALKS` seeded paths and refuses it on the first
failure, with the library's message. The walks prefer structural tokens: one closes strings, objects and arrays
soonest, one opens them and adds members, the others pick at random; every walk leaves reasoning at once through
`</think>`. A walk cannot visit every path: a failure further in still ends that request with an `invalid_grammar`
error (the scheduler's `FINISH_ERROR`), never a 503.

    python -m services.gateway.grammar_check    # the worker: an init line on stdin, then one grammar a line
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from .errors import bad_request, unavailable

DEADLINE_S = 0.4  # compile + walk, CPU time: the scheduler compiles it again on its loop, holding every stream
# Wall time the gateway waits for a verdict: the worker's CPU-time limit above is the grammar's, whatever the machine's
# load; this bound only kills what never answers (a 10 s compile), still within the second a refusal may take. A
# worker that used less than DEADLINE_S of CPU in that time was starved, not stuck (a CI machine running two stacks
# on 2 cores held a 5 ms check of a pydantic schema past 0.7 s): it is waited for, up to STARVED_WALL_S.
WALL_S = 0.7
STARVED_WALL_S = 10.0
VERDICTS = 256  # grammars whose verdict (passed, or the library's error) is kept: clients send one schema many times
WALKS = 4
WALK_TOKENS = 48
START_TIMEOUT_S = 60.0  # a fresh worker loads the tokenizer's vocabulary first
_STACK_BYTES = 4 << 20
_CRASHED = "the structured-output library crashed on this grammar"


class GrammarChecker:
    """The gateway's side: one worker process, one grammar at a time (on its own thread, so a queue of slow checks
    never holds the event loop or the default thread pool)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], ids: dict[str, int]) -> None:
        """`ids`: the token ids of the walks' texts (CLOSE, OPEN, `</think>`) that are single tokens."""
        self._init = json.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos_ids": eos_ids,
                                 "ids": ids}) + "\n"
        self._proc: subprocess.Popen[bytes] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
        # Verdicts that depend on the grammar alone (passed, or the library's own error), most recent last; a
        # crash or a timeout may be the machine's doing and is checked again next time.
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()

    async def check(self, grammar: str, param: str) -> None:
        """Raise a 400 `invalid_grammar` naming `param` when the library cannot run `grammar`."""
        error = await asyncio.get_running_loop().run_in_executor(self._pool, self.verdict, grammar)
        if error is not None:
            raise bad_request(f"invalid {param}: {error}", param=param, code="invalid_grammar")

    def start(self) -> None:
        """Start the worker in the background (else the first constrained request waits for it)."""
        self._pool.submit(self._worker)

    def verdict(self, grammar: str) -> str | None:
        """None when the grammar passed; else why not."""
        if grammar in self._verdicts:
            self._verdicts.move_to_end(grammar)
            return self._verdicts[grammar]
        proc = self._worker()
        assert proc.stdin is not None and proc.stdout is not None
        cpu_before, asked = _cpu_seconds(proc.pid), time.monotonic()

        def starved() -> bool:
            cpu_now = _cpu_seconds(proc.pid)
            return (cpu_before is not None and cpu_now is not None and cpu_now - cpu_before < DEADLINE_S
                    and time.monotonic() - asked < STARVED_WALL_S)

        try:
            proc.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
            proc.stdin.flush()
            line = _read_line(proc.stdout, WALL_S, starved)
        except OSError:
            line = b""
        if line:
            answer = json.loads(line)
            if answer["keep"]:
                self._verdicts[grammar] = answer["error"]
                if len(self._verdicts) > VERDICTS:
                    self._verdicts.popitem(last=False)
            return answer["error"]
        self._drop()
        self.start()  # the next check finds a worker ready
        if line is None:
            return _too_complex()
        return _CRASHED

    def close(self) -> None:
        self._drop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._drop()
        proc = subprocess.Popen([sys.executable, "-m", "services.gateway.grammar_check"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(self._init.encode())
        proc.stdin.flush()
        if _read_line(proc.stdout, START_TIMEOUT_S) != b"ready\n":
            proc.kill()
            proc.wait()
            raise unavailable("structured output is unavailable: the grammar checker did not start")
        self._proc = proc
        return proc

    def _drop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _read_line(stream: IO[bytes], timeout_s: float, extend: Callable[[], bool] = lambda: False) -> bytes | None:
    """One line from the worker: None after `timeout_s` (renewed while `extend()` says so), b"" when it died first."""
    fd, buf = stream.fileno(), b""
    deadline = time.monotonic() + timeout_s
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            if extend():
                deadline = time.monotonic() + timeout_s
                continue
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        buf += chunk
    return buf


def _cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU time from /proc (Linux, where the gateway runs); None where unreadable, and
    then a check is bounded by WALL_S alone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


# ------------------------------------------------------------------------------------------------ the worker

# The walks' preferences, as token texts (the gateway sends their ids): walk 0 closes, walk 1 opens and extends.
CLOSE = ('"', "}", "]", ",")
OPEN = ("{", "[", ",", '"')


def probe(tokenizer, grammar: str, eos_ids: list[int], ids: dict[str, int]) -> str | None:
    """Compile `grammar` and walk it; the library's error, or None. `ids`: the token ids of CLOSE / OPEN texts and
    of `</think>` (those the vocabulary has as one token)."""
    from llguidance import LLMatcher

    from services.common.grammar_limits import parser_limits

    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    orders = [[ids[t] for t in texts if t in ids] for texts in (CLOSE, OPEN)]
    for walk in range(WALKS):
        rng = random.Random(walk)
        for _ in range(WALK_TOKENS):
            token = None if matcher.is_error() or matcher.is_stopped() else \
                _next_token(matcher, eos_ids, ids, orders[walk] if walk < len(orders) else None, rng)
            if token is None:
                break
            matcher.consume_token(token)
        if matcher.is_error():
            return _message(matcher.get_error())
        matcher.reset()
    return None


def _next_token(matcher, eos_ids: list[int], ids: dict[str, int], order: list[int] | None, rng: random.Random
                ) -> int | None:
    """The walk's next token; None once only the end (or nothing, on an error) is left."""
    import numpy as np

    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    allowed = np.unpackbits(words, bitorder="little").astype(bool)  # bit i of word j: token 32 j + i
    allowed[[t for t in eos_ids if t < allowed.size]] = False
    choices = np.flatnonzero(allowed)
    if matcher.is_error() or choices.size == 0:
        return None

    def ok(text: str) -> bool:
        return text in ids and ids[text] < allowed.size and bool(allowed[ids[text]])

    if ok("</think>"):
        return ids["</think>"]
    if order is None:
        return int(choices[rng.randrange(choices.size)])
    if ok('"') and ok("}"):  # free text (a string's inside): close it rather than write braces into it
        return ids['"']
    return next((t for t in order if allowed[t]), int(choices[0]))


def _message(error: str) -> str:
    """The library's error without its placeholder for the verbose part; a bare stop reason explained."""
    text = error.replace("<non-verbose/>", "").strip()
    if text.startswith("NoExtension"):
        return f"the grammar allows no output at this point (llguidance: {text})"
    return text


def _too_complex() -> str:
    return f"the grammar is too complex: it did not compile and run its first tokens within {DEADLINE_S} s"


def _run(tokenizer, grammar: str, eos_ids: list[int], ids: dict[str, int], result: dict) -> None:
    """result: "error" (None = passed) and "keep" (whether the verdict is the grammar's alone: not a CPU-time one,
    which a borderline grammar may get or not)."""
    started = time.thread_time()  # this thread's CPU time: the library compiles and walks on it
    try:
        result["error"] = probe(tokenizer, grammar, eos_ids, ids)
        result["keep"] = True
    except BaseException as exc:  # noqa: BLE001 — the library's panics are BaseExceptions
        result["error"] = f"the structured-output library failed on this grammar: {exc}"
    if time.thread_time() - started > DEADLINE_S:
        result["error"], result["keep"] = _too_complex(), False


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    from llguidance import LLTokenizer

    init = json.loads(stdin.readline())
    tokenizer = LLTokenizer(init["tokenizer"], n_vocab=init["vocab_size"], eos_token=init["eos_ids"])
    stdout.write(b"ready\n")
    stdout.flush()
    threading.stack_size(_STACK_BYTES)
    for line in stdin:
        result: dict = {"error": _CRASHED, "keep": False}
        compile_thread = threading.Thread(target=_run, args=(tokenizer, json.loads(line)["grammar"],
                                                            init["eos_ids"], init["ids"], result))
        compile_thread.start()
        compile_thread.join()
        stdout.write(json.dumps(result).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
