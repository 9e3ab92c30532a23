"""bf16 on CUDA against the fp32 CPU reference, on a tiny but wider checkpoint (REFERENCE/DESIGN §7: GPU code is
checked on a GPU against the torch reference).

- top-1 of bf16 CUDA and fp32 CPU agree on >= 99% of 256 positions (all rows' logits of one prefill);
- chunked prefill (100 + 100 + 56) on CUDA agrees with its own one-shot prefill on >= 99% of positions.

The checkpoint is make-tiny's layout and init at wider dimensions (hidden 512, 8 layers, 16 experts top-4, DSA
index_topk 64 < 256 so sparse selection is active), stored in bfloat16. make-tiny's `write_tiny` takes no width
options, so `write_wide_tiny` drives its building blocks (TinySpec, config_builder, all_tensors, shards) directly.
No transformers import: this runs on the GPU host as is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from services.rank_worker.model.batch import Batch
from services.rank_worker.model.model import Glm5Model
from services.rank_worker.model.tiny import DTYPES, VOCAB_MULTIPLE
from services.rank_worker.model.tiny.config_builder import generation_config, model_config, round_up
from services.rank_worker.model.tiny.shards import plan_shards, write_shards
from services.rank_worker.model.tiny.spec import TinySpec
from services.rank_worker.model.tiny.tensor_spec import materialize
from services.rank_worker.model.tiny.tokenizer_builder import (PAD_TOKEN, STOP_TOKENS, build_tokenizer, token_ids,
                                                               write_tokenizer)
from services.rank_worker.model.tiny.weights import all_tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WIDE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, v_head_dim=64,
            n_routed_experts=16, num_experts_per_tok=4, linear_num_heads=8, linear_head_dim=64, index_n_heads=8,
            index_head_dim=64, index_topk=64)
PROMPT = 256
CHUNKS = [100, 100, 56]
MIN_AGREEMENT = 0.99
BLOCK = 16
DEVICE = "cuda"  # the module-level skip keeps this CUDA-only; the mechanics were checked with "cpu" + bf16


def write_wide_tiny(out: Path, *, seed: int = 0, dtype: str = "bfloat16", **overrides) -> Path:
    """`write_tiny` with TinySpec dimensions replaced: config, tokenizer and sharded weights, make-tiny's layout."""
    torch_dtype = DTYPES[dtype]
    tok = build_tokenizer()
    ids = token_ids(tok)
    spec = TinySpec(**{**WIDE, **overrides})
    spec = dataclasses.replace(spec, vocab_size=round_up(tok.get_vocab_size(), VOCAB_MULTIPLE))
    out.mkdir(parents=True, exist_ok=True)
    pad, eos = ids[PAD_TOKEN], [ids[t] for t in STOP_TOKENS]
    cfg = model_config(spec, token_ids=ids, pad_token_id=pad, eos_token_ids=eos, dtype=dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(pad_token_id=pad, eos_token_ids=eos)))
    write_tokenizer(tok, out)
    specs = all_tensors(spec)
    cap = -(-sum(s.nbytes(torch_dtype) for s in specs) // 3) + max(s.nbytes(torch_dtype) for s in specs)
    write_shards(out, plan_shards(specs, torch_dtype, cap), torch_dtype, lambda s: materialize(s, seed, torch_dtype),
                 progress=False)
    return out


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_wide_tiny(tmp_path_factory.mktemp("wide_tiny") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    # below the tokenizer's special tokens (ids >= 1000), like ordinary text
    return torch.randint(0, 1000, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()


def prefill_logits(model: Glm5Model, ids: list[int], chunks: list[int], device: str) -> torch.Tensor:
    """Logits of every row when `ids` is fed in consecutive chunks (one fresh cache) -> [len(ids), V] fp32 CPU."""
    n_blocks = -(-len(ids) // BLOCK)
    cache = model.new_cache(num_blocks=n_blocks, block_size=BLOCK, num_slots=1)
    out, pos = [], 0
    for n in chunks:
        batch = Batch.single(ids[pos : pos + n], pos, list(range(n_blocks)), slot=0, all_logits=True, device=device)
        out.append(model.forward(batch, cache).logits.float().cpu())
        pos += n
    assert pos == len(ids)
    return torch.cat(out)


def compare(name: str, a: torch.Tensor, b: torch.Tensor) -> float:
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    dprob = (a.softmax(-1) - b.softmax(-1)).abs().max().item()
    dlogit = (a - b).abs().max().item()
    print(f"{name}: top-1 agreement {agree:.2%} over {a.shape[0]} positions, max |dprob| {dprob:.3e}, "
          f"max |dlogit| {dlogit:.3e}")
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return agree


@pytest.fixture(scope="module")
def cuda_model(wide_ckpt: Path) -> Glm5Model:
    return Glm5Model.load(wide_ckpt, dtype=torch.bfloat16, device=DEVICE, progress=False)


def test_bf16_cuda_matches_fp32_cpu_top1(wide_ckpt, prompt, cuda_model):
    ref = prefill_logits(Glm5Model.load(wide_ckpt, dtype=torch.float32, device="cpu", progress=False), prompt,
                         [PROMPT], "cpu")
    ours = prefill_logits(cuda_model, prompt, [PROMPT], DEVICE)
    assert compare("bf16 cuda vs fp32 cpu", ours, ref) >= MIN_AGREEMENT


def test_chunked_prefill_matches_full_on_cuda(prompt, cuda_model):
    full = prefill_logits(cuda_model, prompt, [PROMPT], DEVICE)
    chunked = prefill_logits(cuda_model, prompt, CHUNKS, DEVICE)
    assert compare(f"chunked {CHUNKS} vs full (cuda bf16)", chunked, full) >= MIN_AGREEMENT
