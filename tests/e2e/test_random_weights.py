"""`twinspark up --random-weights`: the ranks draw random quantized weights (W4A16 experts + fp8 elsewhere) for the
checkpoint's config instead of reading its shards, and the stack serves them — TP = 2 over gloo, the official
`openai` client, concurrent replies equal to serial ones."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.stack import TWINSPARK, Stack, start
from tests.model.quant_helpers import QUANT_BLOCK

RANDOM = {"TWINSPARK_RANDOM_WEIGHTS": "w4a16+fp8", "TWINSPARK_RANDOM_BLOCK_SIZE": str(QUANT_BLOCK),
          "TWINSPARK_DRAFTER": "none"}


@pytest.fixture(scope="module")
def stack(tiny_default, tmp_path_factory) -> Stack:
    s = start(tiny_default, tmp_path_factory.mktemp("random_weights"), tp=2, env=RANDOM)
    yield s
    s.down()


def _reply(client: openai.OpenAI, model: str, i: int) -> str:
    r = client.completions.create(model=model, prompt=f"request {i}:", max_tokens=8, temperature=0.7, seed=i)
    return r.choices[0].text


def test_serves_random_quantized_weights_and_burst_equals_serial(stack):
    for rank in (0, 1):
        log = (stack.state_dir / "logs" / f"rank{rank}.log").read_text()
        assert "drawing random w4a16+fp8 weights" in log and "quantized)" in log
        assert "loading weights" not in log  # no shard was read
    client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, timeout=120)
    model = stack.model_name
    serial = [_reply(client, model, i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        burst = list(pool.map(lambda i: _reply(client, model, i), range(4)))
    assert burst == serial and all(serial)


def test_up_refuses_a_bad_recipe_or_the_mtp_drafter(tiny_default, tmp_path):
    for flags, message in ((["--random-weights", "int5"], "or EXPERTS+OTHER of two of them"),
                           (["--random-weights", "exl3", "--drafter", "mtp"], "--drafter copy or none")):
        proc = subprocess.run([TWINSPARK, "up", "--model", str(tiny_default), "--state-dir", str(tmp_path), *flags],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr


def test_drafter_none_in_the_environment_leaves_the_scheduler_without_a_drafter(stack):
    """`up` hands its environment to every role: with TWINSPARK_DRAFTER=none no role may take "none" for a drafter's
    address (the scheduler once did, reported a drafter component and planned one round at a time for it)."""
    import httpx
    health = httpx.get(stack.url + "/health", timeout=30).json()
    assert health["status"] == "ok"
    assert [c["name"] for c in health["components"]] == ["scheduler", "rank0", "rank1"]
