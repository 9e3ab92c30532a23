"""A CPU install runs without any GPU package, and `--device cuda` that cannot run says so in one line.

The suite's own venv has Triton (the interpreter tests need it), so the CPU path is run here with the GPU packages
made unimportable: a module that only the GPU path needs, imported on the CPU path, fails this test
(CI also runs the README's quick start in a venv without dev extras: .ci/quickstart.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common import device_check

# Runs `twinspark ARGS...` with every GPU-only package unimportable, as on a CPU build of torch without extras.
_WITHOUT_GPU_PACKAGES = """
import sys
from importlib.abc import MetaPathFinder

class NoGpuPackages(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "fla", "exllamav3"):
            raise ImportError(f"{name} is not installed (blocked by the test)")
        return None

sys.meta_path.insert(0, NoGpuPackages())
from services.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _twinspark(*args: str, block_gpu: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _WITHOUT_GPU_PACKAGES, *args] if block_gpu else \
        [sys.executable, "-m", "services.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)


def test_generate_on_the_cpu_imports_no_gpu_package(tiny_default: Path):
    proc = _twinspark("generate", "--model", str(tiny_default), "--prompt", "hello", "--max-tokens", "4", "--json",
                      block_gpu=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"]) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can run --device cuda")
@pytest.mark.parametrize("command", [["up"], ["generate", "--model", "unused", "--prompt", "hi"]])
def test_device_cuda_on_a_cpu_only_torch_is_one_clear_line(command: list[str], tmp_path: Path):
    proc = _twinspark(*command, "--device", "cuda", *(["--state-dir", str(tmp_path)] if command == ["up"] else []))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda needs a CUDA build of torch" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "logs").exists()  # nothing was started


def test_device_check_names_a_missing_triton(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = device_check.importlib.util.find_spec
    monkeypatch.setattr(device_check.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("triton", "fla") else real(name, *a))
    assert "needs Triton" in device_check.device_problem("cuda")
    assert device_check.device_warnings("cuda") and "fla-core" in device_check.device_warnings("cuda")[0]
    assert device_check.device_problem("cpu") is None and device_check.device_warnings("cpu") == []


def test_device_check_names_a_hidden_gpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees none" in device_check.device_problem("cuda")
