"""Every bench is a module of the bench package, run from the repository root as `python -m bench.<name>`: its
`--help` names that command and says what it measures."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import bench

BENCHES = sorted(m.name for m in pkgutil.iter_modules(bench.__path__)
                 if hasattr(importlib.import_module(f"bench.{m.name}"), "main"))


def test_the_benches_are_found() -> None:
    assert {"decode_prefill", "kernels", "serve", "whole_model", "results_index"} <= set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_help_names_the_command(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"bench.{name}").main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith(f"usage: python -m bench.{name} ")
    assert len(out.splitlines()) > 3  # the module's text follows the usage
