"""What the tests change in Triton's CPU interpreter: a row-invariant `tl.dot`, and device-function calls that do not
re-patch `triton.language` that the running launch has patched already.

The dot: the interpreter computes `tl.dot` with `np.matmul`, i.e. the machine's BLAS. Some BLAS builds give a row of
the product different bits depending on where the row sits in the operand (OpenBLAS 0.3.30 on AMD Zen 3, as numpy
2.3 ships it, differs for every row of a 128 x 64 @ 64 x 256 tile once the rows move down by one). On a GPU a tile's
row is computed from that row alone, so the exactness tests (a row alone = the same row among others, whole =
chunked, TP=1 = TP=2) hold there and would fail here for a reason that is not the kernels'. numpy's einsum sums
each output element over K in one fixed order, wherever its row is, at the same speed for tiles of these sizes.
This is a stand-in for the GPU's arithmetic, installed only when the interpreter runs (no CUDA).

The patching: a launch patches `triton.language` (its builtins, as the interpreter's) for its whole grid and restores
it afterwards; each call of a `@triton.jit` device function inside it patches again, rescanning the whole module with
`inspect.getmembers` to find builtins that are all patched already — a third of a kernel test's time (the kernels
call their helpers once per program, per loop step). The patch is the same whatever the function (it depends only on
which of `triton.language` / `triton.language.core` the function's module sees), so a device call whose modules the
running launch has patched skips it; anything else goes through the interpreter's own `_patch_lang` as before."""

from __future__ import annotations

import inspect

import numpy as np


def install() -> None:
    """Replace the interpreter's dot and its per-call re-patching (nothing to do without Triton: the kernel tests
    skip themselves)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    if getattr(interpreter, "_twinspark_tests_installed", False):
        return
    interpreter._twinspark_tests_installed = True

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
                (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):  # fp8 operands, as the interpreter does
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        product = np.einsum("...ij,...jk->...ik", a_data, b_data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot
    _skip_repatching(interpreter, tl)


class _Nothing:
    """The scope of a patch that was not needed: nothing to restore."""

    def restore(self) -> None:
        pass


def _skip_repatching(interpreter, tl) -> None:
    patch_lang = interpreter._patch_lang  # the launch's (GridExecutor) and the device call's, looked up by name
    covered: set[int] = set()  # ids of the language modules the running launch has patched; empty between launches
    langs_of: dict[int, frozenset[int]] = {}

    def langs(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in langs_of:  # as _patch_lang picks them
            langs_of[key] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[key]

    def patched_once(fn):
        mine = langs(fn)
        if covered and mine <= covered:
            return _Nothing()  # a device call inside a launch that patched these modules already
        scope = patch_lang(fn)
        if covered:  # a device call that sees another module: patched as the interpreter does (never restored)
            covered.update(mine)
            return scope
        covered.update(mine)  # a launch: its scope is restored when its grid is done
        restore = scope.restore

        def restore_and_forget() -> None:
            covered.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    interpreter._patch_lang = patched_once
