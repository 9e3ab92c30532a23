"""The compose stack for real, under podman: docs/deploy.md's registry-less commands, as written (its block tagged
`<!-- ci: registry-less -->`; the test's own settings — ports, state, model, TP — come from the environment, which
overrides deploy/.env), build the CPU image (on a local Debian base made from Debian's packages: no image registry),
bring up deploy/compose/head.yml (and worker.yml for rank 1 at TP 2) with host networking on loopback — without
Jaeger where its image cannot be pulled — and its replies, through the gateway, are `twinspark up`'s token for token
on the same checkpoint; ./stop.sh leaves no container. Skipped where podman cannot run.

The image is built once per machine: the layer cache keeps every later build (the second start here, the next CI
run) to seconds. Each start prints how long each step took (`done in ... s`); the test prints those lines.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai import OpenAI

from deploy.ctl import engines
from services.rank_worker.distributed import free_port
from tests.e2e.replies import mixed_completions, token_ids
from tests.e2e.stack import start as native_start

REPO = Path(__file__).resolve().parents[2]
BASE_IMAGE = "local/debian:bookworm"
PODMAN = engines.podman(sys.executable)
_why = engines.why_not(PODMAN)
if _why is None and engines.why_not(engines.DOCKER) is None:
    _why = "docker answers here, so the docs' registry-less commands (LAUNCHER=auto) would take docker"
pytestmark = pytest.mark.skipif(_why is not None,
                                reason=f"the registry-less podman path cannot run here: {_why} (see .ci/run)")

BODIES = mixed_completions(6, 25, longest_prompt=60, max_tokens=(6, 16), seed_base=700)  # 3 greedy, 3 seeded
CHAT = {"messages": [{"role": "user", "content": "Reply with OK."}], "max_tokens": 12, "temperature": 0}


def docs_commands() -> tuple[str, str]:
    """docs/deploy.md's registry-less start and stop lines, read as .ci/run reads the README's blocks."""
    spec = importlib.util.spec_from_file_location("readme_block", REPO / ".ci" / "readme_block.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = module.block((REPO / "docs" / "deploy.md").read_text(), "registry-less").splitlines()
    return next(c for c in lines if "./start.sh" in c), next(c for c in lines if c.startswith("./stop.sh"))


def podman(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **PODMAN.env})


def replies(base: str) -> list[list[int]]:
    """The 6 mixed completions' token ids, then the chat completion's, asked with the official client."""
    async def all_completions() -> list[list[int]]:
        return [(await token_ids(base, "completions", b))[0][0][0] for b in BODIES]
    out = asyncio.run(all_completions())
    client = OpenAI(base_url=base + "/v1", api_key="none")
    chat = client.chat.completions.create(model=client.models.list().data[0].id, extra_body={"return_token_ids": True},
                                          **CHAT)
    assert chat.usage.completion_tokens > 0
    return out + [chat.choices[0].model_extra["token_ids"]]


@pytest.fixture(scope="module")
def native_tp2(tiny_default: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    stack = native_start(tiny_default, tmp_path_factory.mktemp("native"), tp=2)
    try:
        return replies(stack.url)
    finally:
        stack.down()


@pytest.fixture(scope="module")
def base_image() -> str:
    t0 = time.monotonic()
    r = subprocess.run([str(REPO / "deploy/podman/debian-base.sh"), BASE_IMAGE], capture_output=True, text=True,
                       timeout=600, env={**os.environ, **PODMAN.env})
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"{r.stdout.strip()} ({time.monotonic() - t0:.0f} s)")
    return BASE_IMAGE


def containers() -> list[str]:
    return [n for n in podman("ps", "-a", "--format", "{{.Names}}").stdout.split() if n.startswith("twinspark")]


def run_compose_stack(tp: int, model: Path, state: Path, base_image: str) -> list[list[int]]:
    """docs/deploy.md's ./start.sh (podman: no docker answers here) at TP `tp` on this machine, the replies, its
    ./stop.sh; checks that nothing is left."""
    assert base_image in docs_commands()[0]
    port = free_port()
    env = {"STATE_DIR": str(state), "MODEL": str(model), "TP": str(tp), "HOST": "127.0.0.1", "PORT": str(port),
           "HEALTH_TIMEOUT": "300", "PYTHON": sys.executable,
           **{k: str(free_port()) for k in ("SCHEDULER_PORT", "DRAFTER_PORT", "MASTER_PORT", "PEER_PORT")},
           "RANK_PORT": str(free_port())}
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR") or k.startswith("PIP_")}

    def run(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=900,
                              env={**base, "PYTHON3": sys.executable, **env})

    assert not containers(), f"containers left from before: {containers()}"
    start, stop = docs_commands()
    t0 = time.monotonic()
    up = run(start)
    try:
        assert up.returncode == 0, up.stdout[-6000:] + up.stderr[-3000:]
        steps = [line for line in up.stdout.splitlines()
                 if line.startswith(("[", "  done in", "twinspark start")) or "tracing off" in line]
        print(f"TP {tp}: ./start.sh took {time.monotonic() - t0:.0f} s\n" + "\n".join(steps))
        assert "podman launcher" in up.stdout and "reply: " in up.stdout  # start.sh's own smoke test passed
        worker = [n for n in containers() if n.startswith("twinspark-rank1")]  # worker.yml's project, rank 1
        assert len(worker) == (tp == 2), containers()
        return replies(f"http://127.0.0.1:{port}")
    finally:
        down = run(stop)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not containers(), f"./stop.sh left containers: {containers()}"
        kept = [p for p in (state / "logs").iterdir() if p.is_dir()]
        assert len(kept) == 1 and (kept[0] / "twinspark.log").stat().st_size > 0


def test_tp1_head_compose_equals_native_tp2(native_tp2, tiny_default, base_image, tmp_path):
    assert run_compose_stack(1, tiny_default, tmp_path, base_image) == native_tp2


def test_tp2_head_and_worker_compose_equal_native_tp2(native_tp2, tiny_default, base_image, tmp_path):
    assert run_compose_stack(2, tiny_default, tmp_path, base_image) == native_tp2
