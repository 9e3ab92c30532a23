"""bench/roofline.py counts a step's weight bytes as the model holds them: a packed recipe's bytes per key (what the
random-weight reader drew), else the run's dtype."""

import torch

from bench import roofline
from bench.random_weights import bench_spec, build_model, text_tensors
from model.quantize.select import Recipe


def test_the_reader_records_every_key_as_drawn_and_dense_counts_agree() -> None:
    spec = bench_spec(tiny=True)
    _, reader = build_model(spec, device="cpu", dtype=torch.float32)
    assert set(reader.stored_bytes) == {t.key for t in text_tensors(spec)}
    assert roofline.param_counts(spec, torch.float32, reader.stored_bytes) == roofline.param_counts(spec, torch.float32)


def test_stored_bytes_replace_the_dtype_bytes() -> None:
    spec = bench_spec(tiny=True)
    keys = [t.key for t in text_tensors(spec)]
    dense = roofline.param_counts(spec, torch.float32)
    packed = roofline.param_counts(spec, torch.float32, dict.fromkeys(keys, 7))
    expert_keys = [k for k in keys if ".mlp.experts.0." in k and ".layers.1." in k]  # one expert of a MoE layer
    assert packed.expert_bytes == 7 * len(expert_keys) < dense.expert_bytes
    assert packed.always == dense.always and packed.always_bytes < dense.always_bytes
    hits = [2] * dense.moe_layers
    ideal = roofline.decode_bytes(spec, torch.float32, [16], hits, stored=dict.fromkeys(keys, 7))
    assert ideal["weight_bytes"] < roofline.decode_bytes(spec, torch.float32, [16], hits)["weight_bytes"]


def test_an_fp8_lm_head_counts_at_its_stored_bytes() -> None:
    spec = bench_spec(tiny=True)
    _, reader = build_model(spec, device="cpu", dtype=torch.float32, recipe=Recipe.parse("bf16+bf16+fp8", block=8))
    head = roofline.param_counts(spec, torch.float32, reader.stored_bytes)
    dense = roofline.param_counts(spec, torch.float32)
    scales = -(-spec.vocab_size // 8) * (spec.hidden_size // 8) * 4  # an fp32 scale per 8 x 8 block
    assert head.lm_head_bytes == head.lm_head + scales  # a byte per weight
    assert dense.always_bytes - head.always_bytes == dense.lm_head_bytes - head.lm_head_bytes  # nothing else packed
