"""Kernel compiles on the request path: each one logged, and counted in the rank's round stats.

The rank compiles and tunes before it reports healthy (warmup.py), yet a Triton kernel is compiled again for every
new specialization of its arguments (an integer equal to 1 or divisible by 16, a pointer's alignment) and every
new autotune key: a round whose shapes the warm-up never met (more sequences in a prompt chunk, another mix of
decode and prompt rows) pays the compile (a fraction of a second to seconds) inside a user's request. Served prompt
rounds of the whole model once took about four times as long to launch on the host as the offline forward takes
(docs/benchmarks.md, "Host work"); this watch says whether compiles are why, and which kernels.

Triton's own runtime hooks (`triton.knobs.runtime.jit_cache_hook` before a compile, `jit_post_compile_hook` after)
are used, chained to any hook already set; they fire for every Triton kernel in the process, fla-core's included.
Nothing fires in Triton's CPU interpreter (it compiles nothing).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("twinspark.rank")

Hook = Callable[..., Any]


class CompileWatch:
    def __init__(self, rank: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.rank = rank
        self._clock = clock
        self._lock = threading.Lock()
        self._started: dict[Any, float] = {}  # a compile's key -> when it began
        self._count = 0
        self._seconds = 0.0
        self._chained: tuple[Hook | None, Hook | None] = (None, None)

    def install(self) -> None:
        """Watch every Triton compile from now on (call once the warm-up is over)."""
        from triton import knobs
        self._chained = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook = self.before
        knobs.runtime.jit_post_compile_hook = self.after

    def uninstall(self) -> None:
        from triton import knobs
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._chained

    def before(self, *, key: Any, **kwargs: Any) -> bool | None:
        """Triton is about to compile a specialization it has not built in this process. Returning a true value
        would skip the compile: the chained hook's answer is passed on, this watch never skips."""
        self._started[_hashable(key)] = self._clock()
        hook = self._chained[0]
        return hook(key=key, **kwargs) if hook is not None else None

    def after(self, *, key: Any, repr: str, fn: Any, **kwargs: Any) -> Any:
        """The compile is done (or was loaded from Triton's disk cache): count and log it."""
        begun = self._started.pop(_hashable(key), None)
        seconds = self._clock() - begun if begun is not None else 0.0
        with self._lock:
            self._count += 1
            self._seconds += seconds
        log.warning("rank %d: Triton compiled %s.%s on the request path in %.0f ms (a specialization the warm-up "
                    "did not meet; against the nearest build it has: %s)", self.rank, getattr(fn, "module", "?"),
                    getattr(fn, "name", "?"), seconds * 1e3, what_changed(getattr(fn, "jit_function", None), key))
        hook = self._chained[1]
        return hook(key=key, repr=repr, fn=fn, **kwargs) if hook is not None else None

    def take(self) -> tuple[int, float]:
        """(compiles, seconds) since the last call."""
        with self._lock:
            out = (self._count, self._seconds)
            self._count, self._seconds = 0, 0.0
        return out


def what_changed(jit: Any, key: Any) -> str:
    """Which arguments of a new build differ from the nearest build the kernel already has, by name: what to mark
    `do_not_specialize` (an integer), `do_not_specialize_on_alignment` (a pointer that may be a slice) or warm up.

    Triton's JIT function keeps, per device, a map from each launch's structured key (one (type, attribute) or
    ("constexpr", value) per parameter, in signature order, and the launch options) to the string `key` the hooks
    receive; the entry whose string is `key` is the new build, the others are the builds it has."""
    caches = getattr(jit, "device_caches", None)
    if not caches:
        return "unknown"
    names = [p.name for p in jit.params]
    for entry in list(caches.values()):
        key_cache = entry[1]
        new = [k for k, v in key_cache.items() if v == key]
        if not new:
            continue
        spec, options = new[0]
        old = [k for k, v in key_cache.items() if v != key]
        if not old:
            return "none (the kernel's first build)"

        def diff(other: tuple) -> list[str]:
            out = [f"{n} {_spec(a)} -> {_spec(b)}" for n, a, b in zip(names, other[0], spec) if a != b]
            return out + (["launch options"] if other[1] != options else [])

        return "; ".join(min((diff(o) for o in old), key=len)) or "the same arguments"
    return "unknown"


def _spec(entry: Any) -> str:
    """('i32', 'D') -> 'i32 D' (divisible by 16 / 16-byte aligned), ('constexpr', 64) -> '=64'."""
    kind, attr = (tuple(entry) + (None, None))[:2]
    if kind == "constexpr":
        return f"={attr}"
    return f"{kind} {attr or '-'}"


def _hashable(key: Any) -> Any:
    try:
        hash(key)
        return key
    except TypeError:
        return str(key)
