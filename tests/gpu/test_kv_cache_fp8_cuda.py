"""`--kv-cache-dtype fp8` on CUDA: bf16 compute over an fp8 (e4m3 + per-row scale) cache against the same bf16
compute over a bf16 cache, on test_cuda_parity's calm checkpoint (its docstring says why that one): a 192-token
prefill, then 64 one-row decode steps over the rest of the prompt (teacher forced, so every step is compared).
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_quant import FP8
from tests.gpu.test_cuda_parity import DEVICE, PROMPT, agreement, calm_ckpt, load_ours, prefill_logits, prompt  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DECODE = 64
MIN_AGREEMENT = 0.97  # fp8 rounds each cached value by up to 2^-4 (bf16: 2^-8), and may flip near-tied DSA pools


def test_fp8_cache_decode_matches_bf16_cache_top1(calm_ckpt, prompt):
    model = load_ours(calm_ckpt)
    chunks = [PROMPT - DECODE] + [1] * DECODE
    ref = prefill_logits(model, prompt, chunks, DEVICE)
    got = prefill_logits(model, prompt, chunks, DEVICE, kv_dtype=FP8)
    decode = slice(PROMPT - DECODE, PROMPT)
    assert agreement("fp8 vs bf16 cache, decode rows (cuda bf16)", got[decode], ref[decode]) >= MIN_AGREEMENT
    assert agreement("fp8 vs bf16 cache, all rows (cuda bf16)", got, ref) >= MIN_AGREEMENT
