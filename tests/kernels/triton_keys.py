"""Which compiled variant each Triton launch would need on a GPU, recorded in Triton's CPU interpreter.

On CUDA, Triton builds one binary per *specialization* of a kernel's arguments: every constexpr's value, and for
the other arguments an integer's width and whether it equals 1 or is a multiple of 16, a pointer's dtype and
whether its address is 16-byte aligned (unless the kernel lists the argument in `do_not_specialize` /
`do_not_specialize_on_alignment`), plus the launch options (warps, stages). A round whose shapes give a key the
rank's warm-up never met compiles on a user's request: 0.2-1.2 s a kernel on an H200
(bench/results/served_profile-20261204-165402 in docs/benchmarks.md). The interpreter compiles nothing, but the
arguments it is handed are the ones a GPU launch would get, so the same key can be computed here with Triton's
own specialization function, and a CPU test can say which kernels and which arguments would compile anew.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from typing import Any, Iterator

from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton._C.libtriton import native_specialize_impl

Key = tuple[tuple[str, Any], ...]  # (argument name, its specialization) in signature order, then launch options


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def launch_key(fn: InterpretedFunction, args: tuple, kwargs: dict) -> tuple[str, Key]:
    """(kernel name, key) of one launch, as Triton's JIT binder would compute it on CUDA."""
    sig = inspect.signature(fn.fn)
    options = {k: v for k, v in kwargs.items() if k not in sig.parameters}
    bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    loose = set(fn.kwargs.get("do_not_specialize") or ())
    unaligned = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    key: list[tuple[str, Any]] = []
    for i, (name, param) in enumerate(sig.parameters.items()):
        value = bound.arguments.get(name)
        if _is_constexpr(param):
            key.append((name, ("constexpr", repr(value))))
        else:
            spec = native_specialize_impl(BaseBackend, value, False, not ({i, name} & loose),
                                          not ({i, name} & unaligned))
            key.append((name, tuple(str(s) for s in spec)))
    key.extend(sorted((k, repr(v)) for k, v in options.items()))
    return f"{fn.fn.__module__}.{fn.fn.__name__}", tuple(key)


class KeyLog:
    """Every (kernel, key) launched while recording, and the launches in order."""

    def __init__(self) -> None:
        self.keys: dict[str, set[Key]] = defaultdict(set)
        self.order: list[str] = []  # every launch's kernel name, in launch order

    def add(self, name: str, key: Key) -> None:
        self.keys[name].add(key)
        self.order.append(name)

    def new_since(self, before: "KeyLog") -> dict[str, list[str]]:
        """Per kernel: for each key not in `before`, the arguments whose specialization differs from the nearest
        key `before` holds (what would have to be unspecialized, or warmed up, so the key is met before serving)."""
        out: dict[str, list[str]] = {}
        for name, keys in self.keys.items():
            old = before.keys.get(name, set())
            for key in keys - old:
                if not old:
                    out.setdefault(name, []).append("(kernel never launched before)")
                    continue
                nearest = min(old, key=lambda o: sum(a != b for a, b in zip(o, key)))
                diffs = [f"{a[0]}: {b[1]} -> {a[1]}" for a, b in zip(key, nearest) if a != b]
                out.setdefault(name, []).append("; ".join(diffs))
        return out


@contextlib.contextmanager
def recording() -> Iterator[KeyLog]:
    """Record the key of every interpreted Triton launch inside the block."""
    log = KeyLog()
    original = InterpretedFunction.run

    def run(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if not warmup:
            log.add(*launch_key(self, args, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield log
    finally:
        InterpretedFunction.run = original
