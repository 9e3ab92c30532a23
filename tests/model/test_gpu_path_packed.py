"""Every linear packed on the fused path: a tiny checkpoint quantized to fp8 (one scale per output channel: the only
fp8 layout whose scale groups the fixed-schedule GEMM steps over at the tiny model's widths) run through the fused
ops with each projection kept in its stored format, against the same fused ops over the weights dequantized at
load. The GEMM dequantizes a tile exactly as the reference codec does (kernels/gpu/wtiles.py), so the two must agree
bit for bit: the format changes the bytes read, never the arithmetic. Run in Triton's CPU interpreter.

On the CPU the loader hands the model dense weights (packing is for CUDA), so `PackedReader`
(tests/model/packed_reader.py) — test-only — claims a
CUDA device to the loader while reading on the CPU, which is what the interpreter computes on."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import triton  # noqa: F401  (skips the module without Triton)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs only without CUDA; on a "
                                "GPU tests/gpu covers packed formats at real dims")

from kernels.gpu.wtiles import Fmt, WeightArgs  # noqa: E402
from model.checkpoint import make_tiny  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.model import Glm5Model  # noqa: E402
from model.parallel import Collective, Sharding  # noqa: E402
from model.quantize.convert import quantize_checkpoint  # noqa: E402
from model.quantize.select import Recipe  # noqa: E402
from model.weights import WeightReader  # noqa: E402
from tests.model.packed_reader import PackedReader  # noqa: E402
from tests.model.reference import CAP, fresh_cache, random_ids, step  # noqa: E402




@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Glm5Model, Glm5Model]:
    """(dequantized, packed) of a 2-layer tiny model (KDA + dense MLP, MLA + MoE: every projection kind, at the
    interpreter's smallest cost) with every eligible linear in per-channel fp8."""
    dense_dir = make_tiny(tmp_path_factory.mktemp("packed_bf16") / "ckpt", seed=5, layers=2, experts=4,
                          layer_pattern="KM")
    path = tmp_path_factory.mktemp("packed_fp8") / "ckpt"
    quantize_checkpoint(dense_dir, path, Recipe("fp8", "fp8", block=None), progress=False)
    sharding = Sharding()  # four virtual shards: every sharded projection is cut four ways
    dense = Glm5Model.load(path, sharding=sharding, dtype=torch.float32, progress=False, load_mtp=False)
    reader = WeightReader(path, sharding, torch.float32, torch.device("cpu"), progress=False)
    try:
        packed = Glm5Model(ModelConfig.from_pretrained(path), PackedReader(reader), Collective(sharding),
                           load_mtp=False)
    finally:
        reader.close()
    packed.device = torch.device("cpu")  # where its caches go: the claim of CUDA was for the loader only
    return dense, packed


def test_every_quantized_linear_stays_packed(models) -> None:
    """Every projection part is packed exactly when its linears are stored quantized; the indexer's key / head
    weights stay dense (the recipe keeps them), so that joined projection runs as two products written into one
    output. KDA's narrow products (f_a | g_a | b, and f_b with g_b stacked) stay dense, each one operand."""
    _, packed = models
    kda = next(layer for layer in packed.layers if layer.is_kda)
    mla = next(layer for layer in packed.layers if not layer.is_kda)
    for proj in (kda.attn.qkv, kda.attn.o_w, mla.attn.x_proj, mla.attn.q_b, mla.attn.o_w, mla.attn.indexer.wq_b,
                 packed.layers[0].ffn.gate_up, packed.layers[0].ffn.down):
        assert isinstance(proj.parts[0], WeightArgs) and proj.parts[0].fmt is Fmt.FP8_CHANNEL
    assert len(kda.attn.qkv.parts) == 1
    assert [type(p).__name__ for p in mla.attn.x_proj.parts] == ["WeightArgs", "Tensor"]
    assert isinstance(packed.lm_head.parts[0], torch.Tensor)
    for proj in (kda.attn.narrow, kda.attn.fg_b):
        assert [type(p).__name__ for p in proj.parts] == ["Tensor"]
    assert kda.attn.fg_b.stacked == 2 and kda.attn.fg_b.shards == 2 * kda.attn.params.shards


def test_packed_fused_forward_equals_dequantized_fused_forward(models) -> None:
    """A prompt round, then a round of a decode row, a verify window and a prompt chunk: logits bit for bit."""
    dense, packed = models
    ids = [random_ids(40, seed=s) for s in range(3)]
    rounds = [[(0, ids[0][:20], 0, True, False), (1, ids[1][:9], 0, True, False)],
              [(1, ids[1][9:10], 9, False, False), (0, ids[0][20:23], 20, False, True),
               (2, ids[2][:12], 0, True, False)]]
    caches = [fresh_cache(m, CAP, slots=3) for m in (dense, packed)]
    for r, seqs in enumerate(rounds):
        want = step(dense, caches[0], seqs, gpu=True)
        got = step(packed, caches[1], seqs, gpu=True)
        for s, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(w, g), f"round {r} sequence {s}: max |d| {(w - g).abs().max():.2e}"
