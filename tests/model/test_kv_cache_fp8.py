"""`--kv-cache-dtype fp8`: MLA latent + indexer rows stored as e4m3 with a per-row fp32 scale (CPU, fp32 compute).

How close to the fp32 cache is close enough: make-tiny's random init is chaotic (tests/gpu/test_cuda_parity.py: every
block adds an O(1) update to O(1) streams, so a small per-layer error grows ~1.5x per layer; bf16 *compute* keeps only
~65-70% top-1 after 8 layers). fp8 storage perturbs each cached value by up to 2^-4 of itself, so the whole-model
checks here are loose, measured bounds, and the tight check is per layer: one MLA layer's output on the same input
over an fp8 vs an fp32 cache. The exactness rules (row, rank, chunk-grid invariance) hold bit for bit.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import ops

from kernels.kv_quant import FP8, FP8_MAX, dequantize_rows, quantize_rows
from kernels.linear import pad_rows
from services.rank_worker import fingerprint
from model.batch import Batch
from services.rank_worker.offline import GenerateRequest, generate_on_model, run_on_ranks
from tests.model.reference import BLOCK, fresh_cache, our_model, random_ids, run_chunks, table
from tests.model.row_batches import CAP, mixed_batch, packed_step, prepare
from tests.model.tp_jobs import logits_and_greedy

PROMPT, DECODE = 64, 32
E4M3_REL = 2.0 ** -4  # half an e4m3 ulp relative to the value (3 mantissa bits)
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # spacing of e4m3's subnormals, in units of the row's scale


@pytest.fixture(params=["tiny_default", "tiny_sparse"])
def ckpt(request):
    return request.getfixturevalue(request.param)


def test_quantize_round_trip_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 96, generator=g) * torch.logspace(-4, 4, 64).unsqueeze(1)  # rows of very different size
    rows[5] = 0.0
    rows[6, 3] = 1e6  # one outlier sets its row's scale; the rest of that row falls into e4m3's subnormals
    q, scale = quantize_rows(rows)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_rows(q, scale, torch.float32)
    bound = torch.maximum(E4M3_REL * rows.abs(), 0.5 * E4M3_SUBNORMAL_STEP * scale.unsqueeze(1))
    assert bool(((back - rows).abs() <= bound * (1 + 1e-6)).all())
    assert torch.equal(back[5], rows[5]) and scale[5] == 1.0  # a zero row: no division by zero, stored exactly
    assert bool((q.float().abs().amax(dim=1)[scale != 1.0] == FP8_MAX).all())  # every row uses e4m3's full range
    # Per row: quantizing a row alone gives the same bits as quantizing it among others.
    q1, s1 = quantize_rows(rows[17:18])
    assert torch.equal(q1.view(torch.uint8), q[17:18].view(torch.uint8)) and torch.equal(s1, scale[17:18])


def test_fp8_cache_halves_bf16_bytes(tiny_sparse):
    model = our_model(tiny_sparse)
    cfg = model.cfg
    fp8 = fresh_cache(model, 64, kv_dtype=FP8)
    widths = [cfg.kv_lora_rank] * len(fp8.latent) + [2 * cfg.index_head_dim] * len(fp8.index_keys)
    assert fp8.kv_bytes_per_block() == BLOCK * sum(w + 4 for w in widths)  # 1 byte a value + a 4-byte scale a row
    assert fp8.kv_bytes_per_block(torch.bfloat16) == BLOCK * sum(2 * w for w in widths)
    assert fresh_cache(model, 64).kv_bytes_per_block() == BLOCK * sum(4 * w for w in widths)  # auto = fp32 here


def test_fingerprint_tells_fp8_from_auto(tiny_sparse):
    kw = dict(model_dir=tiny_sparse, world=2, dtype=torch.bfloat16, device="cuda", virtual_shards=4, num_blocks=8,
              block_size=16, num_slots=4)
    auto, fp8 = fingerprint.settings(**kw, kv_dtype=None), fingerprint.settings(**kw, kv_dtype=FP8)
    assert (auto["kv cache dtype"], fp8["kv cache dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert fingerprint.fingerprint(auto) != fingerprint.fingerprint(fp8)


@torch.inference_mode()
def test_mla_layer_output_close_to_fp32_cache(ckpt):
    """The tight check: every MLA layer on the same 96-row input, over an fp32 and an fp8 cache. Measured: median
    row error 2.4-2.9e-2 (e4m3 rounding of the latent), p80 <= 3.7e-2. Beyond p80 rows whose DSA selection flipped
    (fp8 indexer keys move near-tied pool scores; make-tiny's random indexer has many) differ by up to ~1: 7-10% of
    rows with index_topk 16 (tiny_sparse); with fp32 indexer rows the max was 6e-2."""
    model = our_model(ckpt)
    ids = random_ids(96, seed=3)
    x = pad_rows(torch.randn(len(ids), model.cfg.hidden_size, generator=torch.Generator().manual_seed(4)))
    batch = Batch.single(ids, 0, table(0, len(ids)), all_logits=True)
    mla = [layer.attn for layer in model.layers if not layer.is_kda]

    def outputs(kv_dtype: torch.dtype | None) -> list[torch.Tensor]:
        fwd, selections = ops.begin(batch, fresh_cache(model, len(ids), kv_dtype=kv_dtype), fused=False), {}
        return [attn.forward(x, fwd, selections).sum(0)[: len(ids)] for attn in mla]

    for attn, ref, got in zip(mla, outputs(None), outputs(FP8)):
        rel = (got - ref).norm(dim=1) / ref.norm(dim=1)
        print(f"layer {attn.layer}: output rel err median {rel.median():.2e}, p80 {rel.quantile(0.8):.2e}, "
              f"max {rel.max():.2e}, rows > 0.1: {(rel > 0.1).float().mean():.1%}")
        assert rel.median() <= E4M3_REL and rel.quantile(0.8) <= E4M3_REL


@pytest.fixture
def greedy_case(ckpt):
    """A 64-token prompt, the fp32 cache's 32 greedy tokens after it, and the fp32 logits of all 96 rows."""
    model = our_model(ckpt)
    prompt = random_ids(PROMPT, seed=0)
    tokens = generate_on_model(model, GenerateRequest(prompt_ids=tuple(prompt), max_tokens=DECODE, ignore_eos=True))
    ids = prompt + tokens
    return ids, run_chunks(model, fresh_cache(model, len(ids)), ids, [PROMPT])


def test_logits_and_greedy_tokens_close_to_fp32_cache(ckpt, greedy_case):
    """Prefill 64 + 32 decode steps over the fp32 greedy tokens (teacher forced, so one early flip does not turn
    every later step into a different sequence). Measured (seed 0): tiny_default median row rel err 3.0e-2, decode
    top-1 97% (31/32); tiny_sparse 5.2e-2, 75% (24/32); over seeds 0-3: median 1-7e-2, decode top-1 69-97%."""
    ids, ref = greedy_case
    model = our_model(ckpt)
    got = run_chunks(model, fresh_cache(model, len(ids), kv_dtype=FP8), ids, [PROMPT])
    rel = (got - ref).norm(dim=1) / ref.norm(dim=1)
    decode = slice(PROMPT - 1, len(ids) - 1)  # the rows that predicted the 32 greedy tokens
    agree = (got[decode].argmax(-1) == torch.tensor(ids[PROMPT:])).float().mean().item()
    free = generate_on_model(model, GenerateRequest(prompt_ids=tuple(ids[:PROMPT]), max_tokens=DECODE,
                                                    ignore_eos=True), kv_dtype=FP8)
    same_prefix = next((i for i, (a, b) in enumerate(zip(free, ids[PROMPT:])) if a != b), DECODE)
    print(f"\nfp8 vs fp32 cache: max |dlogits| {(got - ref).abs().max():.2e}, row rel err median {rel.median():.2e} "
          f"p90 {rel.quantile(0.9):.2e}; decode top-1 {agree:.1%}; free-running greedy equal for {same_prefix} tokens")
    assert rel.median() <= 0.1
    assert agree >= 0.6


@pytest.mark.parametrize("chunks", [[64, 64, 18], [7, 30, 27, 82]])
def test_chunked_prefill_equals_whole_with_fp8(tiny_sparse, chunks):
    """Chunks on the KDA 64-row grid give the whole prefill's bits, so the fp8 rows are identical too. Off-grid chunks
    agree at parity level here (3.6e-5; fp32 cache 3-6e-5), but not for every input: fp8 rounding is a step function,
    so a ~1e-7 off-grid difference in a latent value at a rounding midpoint moves it one e4m3 step, which make-tiny's
    chaotic init amplifies (seen once in 6 probes: 3.8 on tiny_sparse, seed 2, chunks [7, 30, 27])."""
    model = our_model(tiny_sparse)
    ids = random_ids(sum(chunks) + 8, seed=7)
    whole = run_chunks(model, fresh_cache(model, len(ids), kv_dtype=FP8), ids, [sum(chunks)])
    chunked = run_chunks(model, fresh_cache(model, len(ids), kv_dtype=FP8), ids, chunks)
    delta = (chunked - whole).abs().max().item()
    print(f"chunks {chunks} + 8 decode vs whole, fp8 cache: max |dlogits| {delta:.2e}")
    if all(n % 64 == 0 for n in chunks[:-1]):
        assert torch.equal(chunked, whole)
    assert delta <= 1e-4


@pytest.fixture(scope="module")
def prepared_fp8(tiny_sparse):
    return prepare(our_model(tiny_sparse), kv_dtype=FP8)


@pytest.mark.parametrize("others", [3, 16])
def test_row_invariance_with_fp8(prepared_fp8, others):
    """A row's logits and the fp8 rows + scales it caches are the same bits alone and packed with others."""
    members, chunk = mixed_batch(others, target=0)
    alone, alone_cache = packed_step(prepared_fp8, [0], chunk)
    together, together_cache = packed_step(prepared_fp8, members, chunk)
    assert torch.equal(alone[0], together[0])
    blocks = torch.tensor(table(0, CAP))
    for name in ("latent", "index_keys"):
        for layer, store in getattr(alone_cache, name).items():
            other = getattr(together_cache, name)[layer]
            assert torch.equal(store.data[blocks].view(torch.uint8), other.data[blocks].view(torch.uint8)), name
            assert torch.equal(store.scale[blocks], other.scale[blocks]), name


@pytest.mark.tp
def test_tp2_equals_tp1_with_fp8(tiny_shared):
    job = partial(logits_and_greedy, ids=random_ids(96, seed=21), prompt_len=64, max_tokens=24, kv_dtype=FP8)
    tp1, tp2 = run_on_ranks(tiny_shared, job, tp=1), run_on_ranks(tiny_shared, job, tp=2)
    assert tp2["tokens"] == tp1["tokens"]
    assert torch.equal(tp2["logits"], tp1["logits"])
