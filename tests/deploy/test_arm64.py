"""The DGX Spark is aarch64: every runtime dependency (pyproject's and the gpu extra's, as deploy/Dockerfile installs
them) must resolve to aarch64 wheels for CPython 3.12 (the NGC PyTorch base's Python), and the image must build its
CUDA extensions for GB10 (sm_121) when built for linux/arm64.

The resolution asks the package registry (pip's resolver with the Spark as its target platform, nothing
installed); offline it skips. The image itself is not built here (its base is NVIDIA's registry's, and an arm64
build would need qemu): the Dockerfile's per-platform arch list is read instead."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# DGX OS 7 and the NGC 26.xx containers are Ubuntu 24.04: glibc 2.39 runs every manylinux wheel up to 2_39 (pip
# matches a --platform tag exactly, so each is named).
PLATFORMS = ["manylinux2014_aarch64", *(f"manylinux_2_{minor}_aarch64" for minor in range(17, 40))]
OFFLINE = ("Failed to establish a new connection", "Temporary failure in name resolution", "NewConnectionError",
           "ConnectTimeout", "Network is unreachable", "ProxyError")


def runtime_requirements() -> list[str]:
    """What deploy/Dockerfile installs: pyproject's dependencies and the gpu extra (torch included here: a native
    install on a Spark takes it from the registry too)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["gpu"]


def test_every_runtime_dependency_resolves_to_an_aarch64_wheel_for_cpython_3_12(tmp_path) -> None:
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("\n".join(runtime_requirements()))
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--only-binary=:all:", *(f"--platform={p}" for p in PLATFORMS), "--python-version=3.12",
                          "--implementation=cp", f"--target={tmp_path / 'target'}", f"--report={report}",
                          "-r", str(reqs)], capture_output=True, text=True, timeout=600)
    if out.returncode and any(sign in out.stderr for sign in OFFLINE):
        pytest.skip(f"the package registry cannot be reached: {out.stderr.strip().splitlines()[-1]}")
    missing = re.findall(r"No matching distribution found for (\S+)", out.stderr)
    assert out.returncode == 0, f"no aarch64 / cp312 wheel for {missing or out.stderr[-2000:]}"
    wheels = {i["metadata"]["name"].lower(): i["download_info"]["url"].rsplit("/", 1)[-1]
              for i in json.loads(report.read_text())["install"]}
    assert {"torch", "triton", "llguidance", "humming-kernels", "grpcio"} <= wheels.keys()
    native = {name: w for name, w in wheels.items() if not w.endswith("-none-any.whl")}
    assert native and all("aarch64" in w for w in native.values()), native


def _stage_arch_lists(dockerfile: str) -> dict[str, str]:
    """base-<platform> stage -> its CUDA_ARCH_LIST default."""
    stages = re.split(r"^FROM ", dockerfile, flags=re.M)[1:]
    out = {}
    for stage in stages:
        name = re.match(r"\S+ AS (base-\w+)", stage)
        arch = re.search(r"^ARG CUDA_ARCH_LIST=(\S+)", stage, flags=re.M)
        if name and arch:
            out[name.group(1)] = arch.group(1)
    return out


def test_the_image_builds_its_cuda_extensions_for_gb10_on_arm64_and_hopper_on_amd64() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert _stage_arch_lists(text) == {"base-amd64": "9.0", "base-arm64": "12.1"}
    assert re.search(r"^FROM base-\$\{TARGETARCH\}$", text, flags=re.M)
    assert "ENV TORCH_CUDA_ARCH_LIST=${CUDA_ARCH_LIST}" in text
