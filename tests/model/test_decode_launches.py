"""Which Triton kernels a decode step launches, block by block, in order: the launch count per layer that
docs/gpu-engine.md ("Launches per decode step") budgets, pinned on every CPU run so that a change adding a launch to
the decode path says so here. The fused path runs in Triton's CPU interpreter on the tiny checkpoint (bf16 weights
held dense, so the experts run the grouped kernels with the shared expert in their stack; packed formats add
humming's launches on a GPU, counted by `bench.decode_prefill --profile`). Torch ops are not seen here (on a GPU
the step also copies its row metadata in and gathers the embedding rows: the profile TSV lists those)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA; on a "
                                "GPU the profile TSV of bench.decode_prefill --profile lists the launches")

from model.checkpoint import make_tiny  # noqa: E402
from model.model import Glm5Model  # noqa: E402
from model.parallel import Sharding  # noqa: E402
from tests.kernels.triton_keys import recording  # noqa: E402
from tests.model.reference import CAP, fresh_cache, random_ids, step  # noqa: E402

HC_PRE = ["_proj_kernel", "_pre_row_kernel"]  # mHC around every block: the projection, the row pass ...
HC_POST = ["_post_kernel"]  # ... and the mix back into the streams
# KDA: f_a|g_a|b, f_b with g_b, q|k|v, the recurrence with its gated norm, o_proj
KDA = ["_gemm_kernel"] * 3 + ["_kda_decode_kernel", "_gemm_kernel"]
DENSE_MLP = ["_gemm_kernel"] * 2  # gate|up, then down reading their SwiGLU
MOE = ["_gemm_kernel", "_route_group_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"]
# MLA with a full indexer: the input projection, the two latent norms, the latent cache row, the indexer's key norm
# and row, its pools and counts, q_b, the indexer's queries, attention and its split combine, W_uv, o_proj
MLA = (["_gemm_kernel", "_rms_norm_kernel", "_rms_norm_kernel", "_write_kernel", "_layer_norm_kernel",
        "_write_kernel", "_pool_kernel", "_count_kernel"] + ["_gemm_kernel"] * 2
       + ["_attention_kernel", "_combine_kernel"] + ["_gemm_kernel"] * 2)
END = ["_mean_rms_norm_kernel", "_gemm_kernel"]  # the streams' mean and norm, lm_head


def _blocks(names: list[str]) -> list[list[str]]:
    """The launches cut after each block's mHC post; the last entry is what follows the last block."""
    out, cur = [], []
    for name in names:
        cur.append(name)
        if name == HC_POST[0]:
            out.append(cur)
            cur = []
    return out + [cur]


def test_a_decode_step_launches_each_block_s_budget(tmp_path) -> None:
    """Layers K (dense MLP), K (MoE), M (MoE): one decode row after a prompt, launch by launch."""
    path = make_tiny(tmp_path / "ckpt", seed=4, layers=3, layer_pattern="KKM")
    model = Glm5Model.load(path, dtype=torch.float32, progress=False, sharding=Sharding(virtual=1))
    cache = fresh_cache(model, CAP, slots=1)
    ids = random_ids(12, seed=1)
    step(model, cache, [(0, ids[:8], 0, True, False)], gpu=True)
    with recording() as log:
        step(model, cache, [(0, ids[8:9], 8, False, False)], gpu=True)
    got = _blocks([name.rsplit(".", 1)[1] for name in log.order])
    want = [HC_PRE + block + HC_POST for block in (KDA, DENSE_MLP, KDA, MOE, MLA, MOE)] + [END]
    assert got == want
    # what docs/gpu-engine.md counts for the tiny model's dense formats: a KDA + MoE layer in 16 launches
    assert len(got[2]) + len(got[3]) == 16
