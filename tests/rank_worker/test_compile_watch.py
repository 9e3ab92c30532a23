"""The rank's watch on kernel compiles after its warm-up (services/rank_worker/compile_watch.py): Triton's runtime hooks
installed and chained, each compile logged with its kernel and time, the counts taken per round-stats window. No
GPU here: Triton's CPU interpreter compiles nothing, so the hooks are called as Triton calls them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from services.rank_worker.compile_watch import CompileWatch
from services.rank_worker.round_stats import RoundStats

triton = pytest.importorskip("triton")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _compile(watch: CompileWatch, clock: Clock, name: str, seconds: float, key: tuple) -> None:
    """What Triton does on a specialization it has not built: the cache hook, the compile, the post-compile hook."""
    fn = SimpleNamespace(module="kernels.gpu.moe", name=name)
    assert watch.before(key=key, repr=f"{name}[num_warps=4](M: i32)", fn=fn, compile={}, is_manual_warmup=False,
                        already_compiled=False) is None  # None: Triton compiles
    clock.t += seconds
    watch.after(key=key, repr=f"{name}[num_warps=4](M: i32)", fn=fn, compile={}, is_manual_warmup=False,
                already_compiled=False)


def test_each_compile_is_logged_and_counted_until_taken(caplog) -> None:
    clock = Clock()
    watch = CompileWatch(0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="twinspark.rank"):
        _compile(watch, clock, "_route_kernel", 0.75, ("route", ["i32"]))
        _compile(watch, clock, "_group_kernel", 0.25, ("group", [["i32", "D"]]))  # an unhashable key
    assert watch.take() == (2, 1.0)
    assert watch.take() == (0, 0.0)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("rank 0: Triton compiled kernels.gpu.moe._route_kernel on the request path in "
                                  "750 ms")


def test_install_chains_the_hooks_already_set_and_uninstall_restores_them() -> None:
    from triton import knobs
    seen: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append("cache") or True
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append("post")
    try:
        watch = CompileWatch(1)
        watch.install()
        assert knobs.runtime.jit_cache_hook == watch.before
        fn = SimpleNamespace(module="m", name="k")
        assert knobs.runtime.jit_cache_hook(key=1, repr="k", fn=fn) is True  # the chained hook's answer
        knobs.runtime.jit_post_compile_hook(key=1, repr="k", fn=fn)
        assert seen == ["cache", "post"]
        watch.uninstall()
        assert knobs.runtime.jit_cache_hook is not watch.before
        assert knobs.runtime.jit_cache_hook(key=1) is True
    finally:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def test_round_stats_line_says_how_many_compiles_its_window_had() -> None:
    clock = Clock()
    watch = CompileWatch(0, clock=clock)
    stats = RoundStats(0, clock=Clock(), compiles=watch.take)
    stats.launched(1, 2.0, behind=False)
    stats.finished(None, None, 1.0)
    assert "kernel compiles" not in stats.line()
    stats.launched(2, 900.0, behind=False, prompt=True)
    _compile(watch, clock, "_attention_kernel", 1.5, ("attention",))
    stats.finished(None, None, 1.0, prompt=True)
    assert stats.line().endswith("; 1 kernel compiles (1.50 s)")


def test_a_compile_names_the_arguments_that_differ_from_the_nearest_build() -> None:
    """Triton's JIT function maps each launch's structured key to the string key its hooks get; the watch finds the
    new build there and names, against the build nearest to it, the arguments whose specialization changed."""
    from services.rank_worker.compile_watch import what_changed
    params = [SimpleNamespace(name=n) for n in ("x_ptr", "s_bt", "MAX_SPLITS")]
    built = ((("*bf16", "D"), ("i32", "D"), ("constexpr", 2)), "opts")
    far = ((("*bf16", ""), ("i32", "D"), ("constexpr", 4)), "opts")  # three arguments off: not the nearest
    new = ((("*bf16", "D"), ("i32", ""), ("constexpr", 3)), "opts")
    jit = SimpleNamespace(params=params, device_caches={0: ({}, {built: "k1", far: "k2", new: "k3"}, None)})
    assert what_changed(jit, "k3") == "s_bt i32 D -> i32 -; MAX_SPLITS =2 -> =3"
    first = SimpleNamespace(params=params, device_caches={0: ({}, {new: "k3"}, None)})
    assert what_changed(first, "k3") == "none (the kernel's first build)"
    assert what_changed(SimpleNamespace(), "k3") == "unknown"  # not a JIT function (another hook's caller)
