"""Programmatic dependent launch (kernels/gpu/pdl.py): every Triton kernel launched from kernels/gpu waits for the
kernel before it before touching memory, and every launch passes the PDL options; the options are off where PDL
cannot run (Triton's interpreter, TWINSPARK_PDL=0, a GPU before sm_90)."""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import pytest

from kernels.gpu import pdl

GPU_DIR = pathlib.Path(pdl.__file__).parent


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)


def _launches(tree: ast.Module, kernels: set[str]) -> list[ast.Call]:
    """`kernel[grid](...)` calls of the module's own jitted functions."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name) and n.func.value.id in kernels]


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in GPU_DIR.glob("*.py") if p.name not in ("pdl.py", "__init__.py"))


def _launched_kernels() -> list[tuple[str, ast.FunctionDef, list[ast.Call]]]:
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        jitted = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)}
        calls = _launches(tree, set(jitted))
        for name in sorted({c.func.value.id for c in calls}):
            found.append((f"{path.stem}.{name}", jitted[name], [c for c in calls if c.func.value.id == name]))
    return found


LAUNCHED = _launched_kernels()
# What a kernel may call before its wait: index arithmetic and L2 prefetches of its weights (kernels/gpu/pdl.py),
# nothing that reads or writes memory. bench.kernel_census checks the same of every build's PTX.
BEFORE_THE_WAIT = {"tl.program_id", "tl.num_programs", "tl.cdiv", "tl.arange", "tl.minimum", "grouped_tile",
                   "prefetch_l2"}


def test_the_census_finds_the_kernels() -> None:
    names = {name for name, _, _ in LAUNCHED}
    assert {"gemm._gemm_kernel", "mhc._pre_row_kernel", "kda._kda_decode_kernel", "moe._route_group_int_kernel",
            "norms._rms_norm_kernel", "mla._attention_kernel"} <= names
    assert len(names) >= 30


@pytest.mark.parametrize("name,fn,calls", LAUNCHED, ids=[n for n, _, _ in LAUNCHED])
def test_every_launched_kernel_waits_first_and_every_launch_passes_the_options(name: str, fn: ast.FunctionDef,
                                                                              calls: list[ast.Call]) -> None:
    last = fn.args.args[-1]
    assert last.arg == "PDL" and ast.unparse(last.annotation) == "tl.constexpr", f"{name}: PDL is not its last arg"
    assert ast.unparse(fn.args.defaults[-1]) == "False", f"{name}: PDL must default to off"
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    waits = [i for i, stmt in enumerate(body) if ast.unparse(stmt) == "wait_for_inputs(PDL)"]
    assert waits, f"{name}: it must wait for its inputs at its top level"
    before = {ast.unparse(c.func) for stmt in body[:waits[0]] for c in ast.walk(stmt) if isinstance(c, ast.Call)}
    assert before <= BEFORE_THE_WAIT, f"{name}: {sorted(before - BEFORE_THE_WAIT)} before waiting for its inputs"
    for call in calls:
        assert any(k.arg is None and ast.unparse(k.value) == "pdl.options()" for k in call.keywords), (
            f"{name}: a launch at line {call.lineno} does not pass **pdl.options()")


def test_options_are_off_in_the_interpreter() -> None:
    # The CPU suite runs the kernels under TRITON_INTERPRET=1 (tests/conftest.py): no PDL there, so no prefetch.
    assert pdl.options() == {}
    assert pdl.prefetch_bytes() == 0


def test_prefetch_helper_only_prefetches() -> None:
    """`prefetch_l2`, the one call before a wait that touches memory, issues PTX prefetches and nothing else."""
    src = (GPU_DIR / "pdl.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "prefetch_l2")
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)]
    assert [ast.unparse(c.func) for c in calls] == ["tl.inline_asm_elementwise"]
    assert ast.literal_eval(calls[0].args[0]).strip() == "prefetch.global.L2 [$1];"


def test_options_with_a_mocked_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mocked GPU (none here): with CUDA available and not interpreting, sm_90 takes PDL, sm_80 does not, and
    TWINSPARK_PDL=0 turns it off (each decided once per process: the cache is cleared between the cases)."""
    monkeypatch.setattr(pdl, "INTERPRET", False)
    monkeypatch.setattr(pdl.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pdl.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pdl.gpu_arch, "facts", lambda index: SimpleNamespace(capability=90))
    monkeypatch.delenv(pdl.ENV, raising=False)

    def options() -> dict[str, bool]:
        pdl.enabled.cache_clear()
        return pdl.options()

    try:
        assert options() == {"PDL": True, "launch_pdl": True}
        monkeypatch.setenv(pdl.ENV, "0")
        assert options() == {}
        monkeypatch.delenv(pdl.ENV)
        monkeypatch.setattr(pdl.gpu_arch, "facts", lambda index: SimpleNamespace(capability=80))
        assert options() == {}
    finally:
        pdl.enabled.cache_clear()
