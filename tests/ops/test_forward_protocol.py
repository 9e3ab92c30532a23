"""Both op sets satisfy the `Forward` Protocol the blocks are written against (model/forward.py): every op with the
Protocol's parameters (names, kinds, which have defaults) in its order, and every attribute set on each forward."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from model.forward import Forward
from ops.reference import ReferenceForward

pytest.importorskip("triton")
from ops.fused import FusedForward  # noqa: E402

IMPLEMENTATIONS = [ReferenceForward, FusedForward]


def _ops() -> list[str]:
    return sorted(n for n, v in vars(Forward).items() if inspect.isfunction(v) and not n.startswith("_"))


def _shape(fn: object) -> list[tuple[str, object, bool]]:
    """(name, kind, has a default) of each parameter after self."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in params]


def _set_in_init(cls: type) -> set[str]:
    """The attributes `cls.__init__` assigns on self."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_the_protocol_lists_the_ops():
    assert {"linear", "shard_linear", "hc_pre", "write_rows", "kda_attention", "dsa_select", "mla_attention",
            "moe", "logits"} <= set(_ops())


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_op_has_the_protocols_parameters(cls: type) -> None:
    for name in _ops():
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        assert _shape(getattr(cls, name)) == _shape(getattr(Forward, name)), f"{cls.__name__}.{name}"


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_attribute_is_set(cls: type) -> None:
    assert set(Forward.__annotations__) <= _set_in_init(cls)


def test_a_mismatch_is_seen():
    class Wrong:
        def write_rows(self, store, values):  # no tail
            ...

    assert _shape(Wrong.write_rows) != _shape(Forward.write_rows)
