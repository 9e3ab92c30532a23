"""The GPU benchmark harness, end to end on the CPU with make-tiny dimensions (`--tiny`), plus its accounting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench import roofline
from bench.random_weights import RandomWeightReader, bench_spec, build_model
from model.parallel import Sharding

ROOT = Path(__file__).resolve().parents[2]


def test_decode_prefill_tiny_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "bench.decode_prefill", "--tiny", "--batches", "1,2", "--prefill", "64",
           "--iters", "1", "--out", str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    assert data["ceilings"]["hbm_copy"]["bytes_per_s"] > 0 and data["ceilings"]["matmul"]["flops_per_s"] > 0
    assert [r["batch"] for r in data["decode"]] == [1, 2]
    for r in data["decode"]:
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and 0 < r["roofline_fraction"]
        assert len(r["experts_hit"]) == 3 and all(1 <= h <= 2 * r["batch"] for h in r["experts_hit"])
    (p,) = data["prefill"]
    assert p["status"] == "ok" and p["tokens"] == 64 and p["tok_per_s"] > 0 and p["flops"] > 0
    assert data["meta"]["layer_pattern"] == "KKKM" and data["meta"]["mlp_pattern"] == "DEEE"
    assert "## Decode" in md and "## Prefill" in md and "## Ceilings" in md


def test_long_context_tiny_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "bench.long_context", "--tiny", "--lengths", "256,640", "--chunk", "128", "--out",
           str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert [(r["tokens"], r["status"]) for r in data["prefill"]] == [(256, "ok"), (640, "ok")]
    for r in data["prefill"]:
        assert r["ttft_s"] > 0 and r["tok_per_s"] > 0 and r["pool_bytes"] > 0 and r["peak_bytes"] > 0
    by = {(r["model"], r["kv_cache_dtype"]): r["bytes_per_token"] for r in data["pool_bytes_per_token"]}
    assert by[("bench model", "fp8")] < by[("bench model", "auto")] < by[("whole model (45 layers)", "auto")]
    assert "## Prefill" in (tmp_path / "smoke.md").read_text()


def test_real_dims_accounting_matches_reference():
    """4 real-dimension layers: 2.01 B parameters read per batch-1 decode step (docs/reference.md §5)."""
    spec = bench_spec(layers=4)
    need = roofline.decode_bytes(spec, torch.bfloat16, [512], [8, 8, 8])
    assert 2.00e9 < need["weight_params"] < 2.02e9
    flops = roofline.prefill_flops(spec, torch.bfloat16, 2048)
    assert flops["total_flops"] > 2 * flops["active_params_per_token"] * 2048


def test_random_reader_dtypes_and_splits():
    spec = bench_spec(layers=4, tiny=True)
    reader = RandomWeightReader(spec, Sharding(virtual=4), torch.bfloat16, "cpu")
    key = "model.language_model.layers.0.self_attn.q_proj.weight"
    parts = reader.split(key, 0)
    assert len(parts) == 4 and all(p.dtype == torch.bfloat16 and p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts), reader.full(key))  # per-key seed: the same tensor every time
    assert reader.full("model.language_model.layers.0.self_attn.A_log").dtype == torch.float32
    assert reader.has("lm_head.weight") and not reader.has("model.visual.blocks.0.norm1.weight")


def test_random_model_forward_is_finite():
    from model.batch import Batch

    spec = bench_spec(layers=4, tiny=True)
    model, _ = build_model(spec, device="cpu", dtype=torch.float32)
    cache = model.new_cache(num_blocks=8, block_size=16, num_slots=1)
    out = model.forward(Batch.single(list(range(1, 100)), 0, list(range(8)), all_logits=True), cache)
    assert out.logits.shape == (99, spec.vocab_size) and torch.isfinite(out.logits).all()


def test_whole_model_dir_is_the_release_config(tmp_path):
    """`bench.whole_model --write-dir`: the release's text config (45 layers 3:1, 3 dense, 288 experts, one MTP
    layer) with make-tiny's tokenizer, and the random-weight reader lists the MTP block's tensors with it."""
    from bench.whole_model import write_model_dir
    from model.config import ModelConfig
    from model.random_weights import spec_from_config, text_tensors
    out = write_model_dir(tmp_path / "release")
    cfg = ModelConfig.from_pretrained(out)
    assert cfg.num_hidden_layers == 45 and cfg.hidden_size == 4096 and cfg.n_routed_experts == 288
    assert cfg.vocab_size == 154880 and cfg.mlp_layer_types.count("dense") == 3
    assert sum(t != "linear_attention" for t in cfg.layer_types) == 11
    assert (out / "tokenizer.json").exists() and not list(out.glob("*.safetensors"))
    keys = {t.key for t in text_tensors(spec_from_config(cfg))}
    assert any(".layers.45.eh_proj" in k for k in keys)  # the MTP block
