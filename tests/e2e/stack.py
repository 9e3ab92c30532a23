"""Bring the real stack up with `twinspark up --detach` (every role its own process on loopback) and down again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.rank_worker.distributed import free_port

TWINSPARK = str(Path(sys.executable).parent / "twinspark")


@dataclass
class Stack:
    url: str            # http://127.0.0.1:PORT
    state_dir: Path
    model: Path
    tp: int

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def model_name(self) -> str:
        return httpx.get(self.v1 + "/models", timeout=10).json()["data"][0]["id"]

    def up_json(self) -> dict:
        return json.loads((self.state_dir / "up.json").read_text())

    def metrics(self) -> dict[str, float]:
        """Unlabelled-sum view of /metrics: name -> summed value over label sets."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{", 1)[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def down(self) -> subprocess.CompletedProcess:
        return subprocess.run([TWINSPARK, "down", "--state-dir", str(self.state_dir)], capture_output=True, text=True,
                              timeout=120)


def start(model: Path, state_dir: Path, *, tp: int = 1, env: dict[str, str] | None = None) -> Stack:
    port = free_port()
    proc = subprocess.run([TWINSPARK, "up", "--detach", "--model", str(model), "--tp", str(tp), "--port", str(port),
                           "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"twinspark up failed:\n{proc.stdout}\n{proc.stderr}"
    stack = Stack(url=f"http://127.0.0.1:{port}", state_dir=state_dir, model=model, tp=tp)
    assert httpx.get(stack.url + "/health", timeout=10).status_code == 200
    return stack


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie still answers kill(0); read its state.
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def wait_until(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
