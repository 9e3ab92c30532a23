"""`twinspark up --replicas N --detach` with the real vllm-router in front (tests/e2e/test_router*.py), and down."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.launcher.fleet import INSTALL_HINT, router_command
from services.rank_worker.distributed import free_port
from tests.e2e.stack import TWINSPARK


@dataclass
class Fleet:
    url: str  # the router: http://127.0.0.1:PORT
    state_dir: Path
    replicas: list[dict]  # up.json's: url, state_dir

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def workers(self) -> dict[str, bool]:
        """The router's view: worker URL -> healthy."""
        return {w["url"]: w["is_healthy"] for w in httpx.get(self.url + "/workers", timeout=10).json()["workers"]}

    def down(self) -> None:
        down = subprocess.run([TWINSPARK, "down", "--state-dir", str(self.state_dir)], capture_output=True, text=True,
                              timeout=120)
        assert down.returncode == 0, down.stderr


def start_fleet(model: Path, state: Path, *extra: str, replicas: int = 2) -> Fleet:
    """Replicas of `model` (TP 1, no drafter) behind the router; skips the test when vllm-router is missing."""
    if router_command(None) is None:
        pytest.skip(f"vllm-router is not installed: {INSTALL_HINT} (the dev extra installs it on Linux)")
    port = free_port()
    t0 = time.monotonic()
    up = subprocess.run([TWINSPARK, "up", "--replicas", str(replicas), "--detach", "--model", str(model), "--port",
                         str(port), "--state-dir", str(state), "--drafter", "none", *extra],
                        capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, f"twinspark up --replicas {replicas} failed:\n{up.stdout}\n{up.stderr}"
    print(f"\n{replicas} replicas and vllm-router ({' '.join(extra) or 'cache_aware'}) up in "
          f"{time.monotonic() - t0:.1f} s")
    info = json.loads((state / "up.json").read_text())
    return Fleet(url=f"http://127.0.0.1:{port}", state_dir=state, replicas=info["replicas"])
