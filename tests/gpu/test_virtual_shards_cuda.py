"""Virtual shards at real GLM-5.3-Flash widths on the GPU: a rank's local shards in one launch per op give each shard
the bits of its own one-shard launch (docs/design.md §5.3: TP=1 = TP=2 = TP=4).

Two layers (KDA, MLA/DSA; dense FFNs) are built over the same random bf16 weights as a TP=1 rank (4 virtual shards
per launch) and as the 4 ranks of TP=4 (one shard each). No collective is needed: a layer's attention and FFN
return their per-shard partials before it, so the test runs them side by side in one process on one GPU. The same
rounds (prompt chunks; then decode rows, a verify window and a prompt's next chunk) give bit-identical partials,
and the KDA states and conv histories of each shard stay identical."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16
CAP = 512  # positions per sequence


def build(spec, sharding, device: str, dtype: torch.dtype):
    from bench.random_weights import bench_config
    from model.model import Glm5Model
    from model.parallel import Collective
    from model.random_weights import RandomWeightReader
    reader = RandomWeightReader(spec, sharding, dtype, device, seed=0)
    return Glm5Model(bench_config(spec), reader, Collective(sharding), load_mtp=False)


def rounds(vocab: int) -> list[list[tuple]]:
    """(slot, ids, start, prompt, verify), decode-class sequences first."""
    ids = [torch.randint(0, vocab, (CAP,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    return [[(0, ids[0][:100], 0, True, False), (1, ids[1][:64], 0, True, False), (2, ids[2][:37], 0, True, False)],
            [(0, ids[0][100:101], 100, False, False), (1, ids[1][64:68], 64, False, True),
             (2, ids[2][37:64], 37, True, False)]]


def compare_shards(spec, device: str, dtype: torch.dtype) -> None:
    """Every layer's attention and FFN partials (and KDA caches) of a 4-shard rank vs 4 one-shard ranks."""
    from model.batch import Batch
    from model.parallel import Sharding
    from ops.fused import FusedForward
    fused = build(spec, Sharding(), device, dtype)
    ranks = [build(spec, Sharding(rank=r, world=4), device, dtype) for r in range(4)]
    models = [fused, *ranks]
    caches = [m.new_cache(num_blocks=3 * CAP // BLOCK, block_size=BLOCK, num_slots=3) for m in models]
    gen = torch.Generator().manual_seed(1)
    for r, seqs in enumerate(rounds(spec.vocab_size)):
        ids = [i for _, new, *_ in seqs for i in new]
        batch = Batch(token_ids=torch.tensor(ids, device=device), starts=[st for _, _, st, _, _ in seqs],
                      lengths=[len(new) for _, new, *_ in seqs],
                      block_tables=torch.tensor([list(range(s * CAP // BLOCK, (s + 1) * CAP // BLOCK))
                                                 for s, *_ in seqs], device=device),
                      slots=[s for s, *_ in seqs], logit_rows=torch.arange(len(ids)), verify=[v for *_, v in seqs],
                      prompt=[p for *_, p, _ in seqs])
        fwds = [FusedForward(batch, c) for c in caches]
        x = (torch.randn(len(ids), spec.hidden_size, generator=gen) * 0.5).to(dtype=dtype, device=device)
        for i in range(spec.num_hidden_layers):
            want = fused.layers[i].attn.forward(x, fwds[0], {})
            got = torch.cat([m.layers[i].attn.forward(x, f, {}) for m, f in zip(ranks, fwds[1:])])
            assert torch.equal(want, got), f"round {r} layer {i} attention: max |d| {(want - got).abs().max():.1e}"
            want = fused.layers[i].ffn.forward(x, fwds[0])
            got = torch.cat([m.layers[i].ffn.forward(x, f) for m, f in zip(ranks, fwds[1:])])
            assert torch.equal(want, got), f"round {r} layer {i} ffn: max |d| {(want - got).abs().max():.1e}"
        for m, c in zip(models, caches):
            m.commit_verify(batch, c, {1: 2})
        for i in spec_kda_layers(spec):
            heads, chans = caches[1].kda_state[i].shape[1], caches[1].conv_state[i].shape[2]
            for k, c in enumerate(caches[1:]):
                assert torch.equal(caches[0].kda_state[i][:, k * heads:(k + 1) * heads], c.kda_state[i]), \
                    f"round {r} layer {i} shard {k}: KDA state"
                assert torch.equal(caches[0].conv_state[i][:, :, k * chans:(k + 1) * chans], c.conv_state[i]), \
                    f"round {r} layer {i} shard {k}: conv history"


def spec_kda_layers(spec) -> list[int]:
    return [i for i, c in enumerate(spec.layer_pattern) if c == "K"]


def test_shards_in_one_launch_equal_one_launch_per_shard_at_real_dims() -> None:
    from bench.random_weights import bench_spec
    spec = dataclasses.replace(bench_spec(layers=2, layer_pattern="KM"), dense_layers=2)  # dense FFNs: the MoE
    compare_shards(spec, "cuda", torch.bfloat16)  # has its own shard test (tests/kernels/test_gpu_moe.py)
