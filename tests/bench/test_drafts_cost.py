"""bench/drafts_cost.py end to end on the CPU with make-tiny dimensions (`--tiny`): every table filled."""

from __future__ import annotations

import json
from pathlib import Path

from bench import drafts_cost


def test_drafts_cost_tiny_end_to_end(tmp_path: Path) -> None:
    rc = drafts_cost.main(["--tiny", "--drafts", "4,16", "--context", "64", "--contexts", "32,64", "--iters", "2",
                           "--warmup", "1", "--out", str(tmp_path), "--name", "smoke"])
    assert rc == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    assert data["errors"] == []
    (decode,) = data["target"]["decode"]  # no CUDA graphs on the CPU: the eager step only
    assert decode["status"] == "ok" and decode["mode"] == "eager" and decode["median_ms"] > 0
    assert [r["drafts"] for r in data["target"]["verify"]] == [4, 16]
    for r in data["target"]["verify"]:
        assert r["status"] == "ok" and r["mode"] == "eager", r
        assert r["rows"] == r["logit_rows"] == 1 + r["drafts"]  # logits for every row of the window
        assert r["median_ms"] > 0 and r["ratio"] > 0 and r["ratio_eager"] > 0
    assert [r["rows"] for r in data["drafter"]["fuse"]] == [1, 17]
    assert [r["context"] for r in data["drafter"]["propose"]] == [32, 64]
    for r in data["drafter"]["fuse"] + data["drafter"]["propose"]:
        assert r["status"] == "ok" and r["median_ms"] > 0, r
    assert all(r["drafts_per_block"] == 15 for r in data["drafter"]["propose"])
    assert data["drafter"]["config"]["num_hidden_layers"] == 5
    assert [r["drafts"] for r in data["rounds"]] == [4, 16] and all(r["round_ms"] > 0 for r in data["rounds"])
    summary = data["summary"]
    assert summary.startswith("drafter call at context 64: ") and "verify 16 drafts / decode = " in summary
    assert "(target <= 2)" in summary and summary in md
    assert "## Target" in md and "## Drafter" in md and "## A round with K drafts" in md
