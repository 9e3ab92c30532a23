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


def test_soak_bench_gpu_mix(stack, tmp_path):
    """The GPU soak's mix on the tiny window: lengths capped, the 200k prompt a clean 400 (refused, not lost), every
    request counted once, the per-minute table written."""
    r = _run("bench.soak", "--state-dir", str(stack.state_dir), "--mix", "gpu", "--duration", "25", "--clients", "4",
             "--max-prompt", "64", "--warmup-minutes", "0", "--out", str(tmp_path))
    data = json.loads(next(tmp_path.glob("soak-*.json")).read_text())
    s = data["summary"]
    assert s["requests"] > 2 and s["replies"] > 0 and s["lost"] == 0 and s["5xx"] == 0, (s, data["lost_examples"])
    assert s["kv_cache_usage_perc_end"] == 0 and s["restarts"] == 0
    assert data["long_prompt"]["outcome"] == "refused_400" and data["refusals"].get("400 context_length_exceeded")
    assert data["images"] is True  # the tiny checkpoint has a vision tower: the probe was answered
    assert s["requests"] == s["replies"] + sum(s["refused"].values()) + s["cancelled"] + s["disconnected"] + s["lost"]
    minutes = data["minutes"]
    assert sum(m["sent"] for m in minutes) == s["requests"] == sum(
        m["answered"] + sum(m["refused"].values()) + m["cut"] + m["lost"] for m in minutes)
    assert sum(k["sent"] for k in data["by_kind"].values()) == s["requests"]
    assert all(m["kv_usage_max"] is not None and m["rss_mb"] for m in minutes)  # /metrics and RSS sampled
    md = next(tmp_path.glob("soak-*.md")).read_text()
    assert "| minute | sent | answered | refused | cut | lost | 5xx |" in md and "Steady minutes" in md
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]  # no steady minute in 25 s: nothing else to judge


def test_soak_steady_figures():
    """The per-minute rows and issue 54's steady figures from made-up records and samples (no stack): minute 1 is
    warm-up, minute 4 has too little load to count, drifts compare minute 2 with minute 3."""
    from bench.soak import Record, Sample, done_when, per_minute, steady
    records = [Record("chat", 10, 50, "reply", "200", 0.5, [0.01] * 98 + [0.5]),
               Record("chat", 65, 100, "reply", "200", 0.4, [0.01] * 99 + [0.03]),
               Record("chat", 70, 130, "reply", "200", 0.4, [0.01] * 97 + [0.03] * 3),
               Record("long", 1, 2, "refused_400", "400"), Record("chat", 150, 170, "lost", "500")]
    samples = [Sample(t, {"rank0": (100 + (t >= 120)) << 20}, gpu_mib=1000 + (t >= 120) * 5)
               for t in range(0, 200, 10)]
    rows, itl = per_minute(records, samples, ran_s=200)
    assert [m["sent"] for m in rows] == [2, 2, 1, 0] and [m["answered"] for m in rows] == [1, 1, 1, 0]
    assert rows[0]["refused"] == {"400": 1} and rows[2]["lost"] == rows[2]["5xx"] == 1
    st = steady(rows, itl, warmup=1, load_s=200)
    assert st["minutes"] == [2, 3] and st["gpu_memory_drift"] == 0.005 and st["rss_drift"] == {"rank0": 0.01}
    assert st["itl_p50_ms"] == 10.0 and st["itl_p99_over_median"] == 3.0  # minute 1's 500 ms gap left out
    checks = done_when({"lost": 1, "5xx": 1}, st)
    assert checks == {"lost": False, "5xx": False, "gpu_memory_flat": True, "rss_flat": True, "itl_tail": False}


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


def test_rank_kill_bench(stack, tmp_path):
    """bench/rank_kill.py on the shared stack (last in this file: it kills the stack's rank, which restarts)."""
    r = _run("bench.rank_kill", "--state-dir", str(stack.state_dir), "--tp", "1", "--streams", "2",
             "--stream-tokens", "200", "--recovery-s", "180", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    data = json.loads(next(tmp_path.glob("rank_kill-*.json")).read_text())
    assert data["rank"] == "rank0" and data["errors_within_bound"] == 2 and data["outage_status"] == 503
    assert data["same_ids"] == data["prompts"] and data["restarts"]["after"] == {"rank": 1}
    assert "| replies after recovery = before | 4/4 |" in next(tmp_path.glob("rank_kill-*.md")).read_text()
