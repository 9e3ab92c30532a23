"""bench/fuzz.py, bench/soak.py and bench/serve.py, short, against one real stack (`twinspark up`, TP = 1): they
run, count, and write their JSON + markdown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import Stack, start

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(tiny_default, tmp_path_factory) -> Stack:
    s = start(tiny_default, tmp_path_factory.mktemp("stack_bench"), tp=1, env={"TWINSPARK_MAX_MODEL_LEN": "256"})
    yield s
    s.down()


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_fuzz_bench(stack, tmp_path):
    r = _run("bench.fuzz", "--state-dir", str(stack.state_dir), "--requests", "80", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(next(tmp_path.glob("fuzz-*.json")).read_text())
    s = data["summary"]
    assert s["requests"] == 80 and s["5xx"] == 0 and s["hangs"] == 0 and s["restarts"] == 0
    from bench import hostile, malformed
    assert set(data["by_kind"]) == set(malformed.KINDS) | set(hostile.KINDS)  # every kind of both sets was sent
    assert "| 5xx | wrong error shape | stream errors of ours | hangs |" in next(tmp_path.glob("fuzz-*.md")).read_text()


def test_soak_bench(stack, tmp_path):
    r = _run("bench.soak", "--state-dir", str(stack.state_dir), "--duration", "25", "--clients", "6", "--out",
             str(tmp_path))
    data = json.loads(next(tmp_path.glob("soak-*.json")).read_text())
    s = data["summary"]
    assert s["requests"] > 0 and s["replies"] > 0 and s["lost"] == 0, (s, data["lost_examples"])
    assert s["kv_cache_usage_perc_end"] == 0 and s["restarts"] == 0
    assert {"gateway", "scheduler", "rank0"} <= set(data["rss_samples"])
    assert all(len(v) >= 3 for v in data["rss_samples"].values())  # every 10 s over 25 s
    assert r.returncode in (0, 1), r.stderr[-2000:]  # 1 only when memory moved > 5% in so short a run


def test_serve_bench(stack, tmp_path):
    r = _run("bench.serve", "--state-dir", str(stack.state_dir), "--concurrency", "1,3", "--requests", "3",
             "--prompt-len", "12", "--output-len", "5", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(next(tmp_path.glob("serve-*.json")).read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 3]
    for lv in data["levels"]:
        assert lv["completed"] == lv["requests"] == 3 and lv["output_throughput"] > 0
        assert lv["ttft"]["median_ms"] > 0 and lv["itl"]["median_ms"] > 0 and lv["tpot"]["p99_ms"] > 0
        assert lv["warmup_s"] > 0  # each level measured after an untimed pass of its own
    assert "| concurrency | requests |" in next(tmp_path.glob("serve-*.md")).read_text()


def test_whole_model_served_prefill(stack):
    """bench/whole_model.py's prompt line: one prompt alone after an untimed one, its TTFT and prompt tok/s."""
    from bench.whole_model import markdown, served_prefill
    p = served_prefill(stack.url + "/v1", 64)
    assert p["tokens"] == 64 and p["ttft_s"] > 0 and p["tok_s"] == pytest.approx(64 / p["ttft_s"])
    row = {"format": "bf16", "ready_s": 1.0, "prefill": [p]}
    md = markdown({"date": "now", "model": "m", "config": {}, "tp": 1, "prompt_len": 1, "output_len": 1,
                   "formats": [row]})
    assert f"| bf16 | 64 | {p['ttft_s']:.3f} |" in md
