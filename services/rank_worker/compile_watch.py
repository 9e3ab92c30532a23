"""Kernel compiles on the request path: each one logged, and counted in the rank's round stats.

The rank compiles and tunes before it reports healthy (warmup.py), yet a Triton kernel is compiled again for every
new specialization of its arguments (an integer equal to 1 or divisible by 16, a pointer's alignment) and every
new autotune key: a round whose shapes the warm-up never met (more sequences in a prompt chunk, another mix of
decode and prompt rows) pays the compile (a fraction of a second to seconds) inside a user's request. Served prompt
rounds of the whole model took ~1 s of host time where the offline forward takes ~0.25 s
(bench/results/whole_model-20261204-134632); this watch says whether compiles are why, and which kernels.

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
                    "did not meet): %s", self.rank, getattr(fn, "module", "?"), getattr(fn, "name", "?"),
                    seconds * 1e3, repr[:400])
        hook = self._chained[1]
        return hook(key=key, repr=repr, fn=fn, **kwargs) if hook is not None else None

    def take(self) -> tuple[int, float]:
        """(compiles, seconds) since the last call."""
        with self._lock:
            out = (self._count, self._seconds)
            self._count, self._seconds = 0, 0.0
        return out


def _hashable(key: Any) -> Any:
    try:
        hash(key)
        return key
    except TypeError:
        return str(key)
