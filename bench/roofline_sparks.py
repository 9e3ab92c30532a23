"""What two DGX Sparks would do with this engine, predicted from its own counts, beside the seed's figures.

    python -m bench.roofline_sparks                 # two Sparks (gb10x2), the seed's recipe, and the H200 check
    python -m bench.roofline_sparks --hardware h200 --recipe exl3:2.5+fp8

The model of a step (assumptions, each stated where it is used):
- decode: every rank streams its share of the weights the step touches (bench/roofline.decode_bytes over the
  recipe's packed bytes per tensor as RandomWeightReader draws them, on the meta device: the shared weights, the
  distinct routed experts the rows pick under uniform routing, the embedding rows, KDA states and the fp8 MLA
  cache at a 8k context), at ENGINE_BW_EFF of the memory's bandwidth (the engine's batch-1 GEMMs on an H200 ran at
  2.2-3.1 TB/s of ~4.3: docs/benchmarks.md); the EXL3 experts at least at their trellis decode's rate (integer
  work: 2.3 T weights/s on an H200's 132 SMs, scaled by SMs x clock); every kernel launch a fixed LAUNCH_S (the
  H200 profile: 1,325 launches in a 45-layer step, ~3 us each for the small ones); with TP 2, one all-gather of fp32
  partials per attention and per FFN block plus the logits (latency of the link's small collectives, measured on
  two Sparks, plus bytes at 200 Gb/s).
- prefill: FLOPs per prompt token (bench/roofline.prefill_flops: 2 x active parameters + attention with the DSA
  selection) at ENGINE_MMA_EFF of the bf16 tensor peak (the engine's 8k prefill on an H200: ~35% of its matmul
  roofline), plus the EXL3 experts' decode of a 16-slot tile per 16 rows an expert gets, per chunk of the step
  budget, at the decode rate above; split over the ranks.
Hardware figures are the vendors' (GB10: 273 GB/s LPDDR5X, 48 SMs at the seed's 2.2 GHz cap, bf16 dense taken as
1/8 of the "1 PFLOP" FP4-with-sparsity headline; H200: 4.8 TB/s, 132 SMs at 1.98 GHz, 989 TFLOPS bf16).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from bench import flags
from bench.roofline import decode_bytes, param_counts, prefill_flops
from model.checkpoint.spec import TinySpec

ENGINE_BW_EFF = 0.65
ENGINE_MMA_EFF = 0.35
# A launch's fixed cost, the run of a latency-bound small kernel (mHC, routing, norms, KDA's step) and its gap: the
# 4-layer H200 profile's ~4.5 ms of such kernels over ~1,100 launches a step (docs/benchmarks.md, stop 43). Taken
# as the same on GB10 (not measured: fewer, slower-clocked SMs may make it longer).
LAUNCH_S = 3e-6
LAUNCHES_PER_LAYER = 1325 / 45  # the whole model's batch-1 step on an H200 (decode_prefill-20261204-104936)
EXL3_WEIGHTS_PER_SM_GHZ = 2.3e12 / (132 * 1.98)  # the CUDA EXL3 product's decode on an H200, per SM and GHz
CHUNK = 8192  # the step budget on CUDA: prompt tokens per round
CONTEXT = 8192  # the decode rows' context (their KV reads)
# The seed's figures as its article and docs/reference.md §2 / §7 give them (theirs, two Sparks, not measured here).
SEED_DECODE = "31-34 tok/s a request without drafts (a 29.6 ms step); 60.4 at 1, 27.9 a request at 4 with DFlash2"
COMMITTED_STEP_S = 12.2e-3  # the H200's batch-1 ITL, whole_model-20261205-115332 (exl3:2.5+fp8)
SEED_PREFILL = {8192: 1952.0, 65536: 1943.0, 1_048_576: 1015.0}  # 982k for the last: TTFT 967 s


@dataclass(frozen=True)
class Hardware:
    name: str
    ranks: int
    bandwidth: float  # bytes/s, one rank's memory
    sms: int
    ghz: float
    bf16_flops: float  # dense tensor peak, one rank
    link_bytes_s: float  # between ranks (0: one rank)
    collective_s: float  # a small all-gather's latency


HARDWARE = {
    "gb10x2": Hardware("two DGX Sparks (GB10), TP 2 over 200 Gb/s RoCE", 2, 273e9, 48, 2.2, 1e15 / 8, 200e9 / 8,
                       31.7e-6),  # an NCCL all-reduce of 16 KB on two Sparks (docs/reference.md §7)
    "h200": Hardware("one H200, TP 1", 1, 4.8e12, 132, 1.98, 989e12, 0.0, 0.0),
}


def stored_bytes(recipe: str) -> dict[str, int]:
    """Bytes per tensor as `recipe` packs it (RandomWeightReader's own count, drawn on the meta device)."""
    from model.parallel import Sharding
    from model.quantize.select import Recipe
    from model.random_weights import RandomWeightReader

    reader = RandomWeightReader(TinySpec(), Sharding(), torch.bfloat16, "meta", recipe=Recipe.parse(recipe))
    for key in reader.tensors:
        reader.full_packed(key)
    return reader.stored_bytes


def distinct_experts(rows: int, spec: TinySpec) -> float:
    """Expected distinct routed experts `rows` rows pick in one layer, routed uniformly at random."""
    e, k = spec.n_routed_experts, spec.num_experts_per_tok
    return e * (1 - (1 - k / e) ** rows)


def decode_step_s(hw: Hardware, spec: TinySpec, stored: dict[str, int], rows: int) -> dict[str, float]:
    """One decode step of `rows` sequences, per rank, by the model in the module docstring."""
    hit = distinct_experts(rows, spec)
    moe_layers = sum(1 for m in spec.mlp_layer_types if m == "sparse")
    moved = decode_bytes(spec, torch.bfloat16, [CONTEXT] * rows, [round(hit)] * moe_layers,
                         kv_dtype=torch.float8_e4m3fn, stored=stored)
    pc = param_counts(spec, torch.bfloat16, stored)
    expert_bytes = pc.expert_bytes * hit * moe_layers / hw.ranks
    stream = (moved["total_bytes"] / hw.ranks - expert_bytes) / (hw.bandwidth * ENGINE_BW_EFF)
    decode_rate = EXL3_WEIGHTS_PER_SM_GHZ * hw.sms * hw.ghz
    experts = max(expert_bytes / (hw.bandwidth * ENGINE_BW_EFF), pc.expert * hit * moe_layers / hw.ranks / decode_rate)
    launches = LAUNCHES_PER_LAYER * (spec.num_hidden_layers + 1) * LAUNCH_S
    gathers = 0.0
    if hw.ranks > 1:  # fp32 partials of the rank's half of the virtual shards, per block, and the logits
        per = rows * spec.hidden_size * 4 * 2
        count = 2 * (spec.num_hidden_layers + 1) + 1
        gathers = count * (hw.collective_s + per / hw.link_bytes_s)
    total = stream + experts + launches + gathers
    return {"weights_s": stream, "experts_s": experts, "launches_s": launches, "collectives_s": gathers,
            "step_s": total, "tok_s_per_request": 1 / total, "tok_s": rows / total}


def prefill_tok_s(hw: Hardware, spec: TinySpec, tokens: int) -> float:
    """Prompt tokens a second over a whole prompt of `tokens`, by the model in the module docstring."""
    flops = prefill_flops(spec, torch.bfloat16, tokens)["total_flops"]
    mma = flops / hw.ranks / (hw.bf16_flops * ENGINE_MMA_EFF)
    pc = param_counts(spec, torch.bfloat16)
    moe_layers = sum(1 for m in spec.mlp_layer_types if m == "sparse")
    per_expert = -(-CHUNK * spec.num_experts_per_tok // spec.n_routed_experts)  # rows an expert gets a chunk
    tiles = spec.n_routed_experts * -(-per_expert // 16)
    decoded = tiles * pc.expert * moe_layers * (tokens / CHUNK) / hw.ranks
    return tokens / (mma + decoded / (EXL3_WEIGHTS_PER_SM_GHZ * hw.sms * hw.ghz))


def report(hardware: str, recipe: str) -> str:
    hw = HARDWARE[hardware]
    spec = TinySpec(num_hidden_layers=45, dense_layers=3, num_nextn_predict_layers=1)
    stored = stored_bytes(recipe)
    lines = [f"{hw.name}, {recipe}, fp8 KV at a {CONTEXT:,}-token context:"]
    for rows in (1, 4):
        d = decode_step_s(hw, spec, stored, rows)
        parts = ", ".join(f"{k[:-2]} {d[k] * 1e3:.2f} ms" for k in ("weights_s", "experts_s", "launches_s",
                                                                    "collectives_s"))
        lines.append(f"  decode at {rows}: step {d['step_s'] * 1e3:.1f} ms ({parts}) -> "
                     f"{d['tok_s_per_request']:.1f} tok/s a request, {d['tok_s']:.1f} in all")
    for tokens in SEED_PREFILL:
        rate = prefill_tok_s(hw, spec, tokens)
        lines.append(f"  prefill {tokens:,}: {rate:,.0f} tok/s, first token after {tokens / rate:,.0f} s")
    if hardware == "h200":
        got = decode_step_s(hw, spec, stored, 1)["step_s"]
        lines.append(f"  cross-check: the committed whole model (exl3:2.5+fp8, whole_model-20261205-115332) ran "
                     f"{COMMITTED_STEP_S * 1e3:.1f} ms a step, 82.0 tok/s: predicted {got / COMMITTED_STEP_S:.0%} "
                     f"of it")
    if hardware == "gb10x2":
        lines.append(f"  the seed: {SEED_DECODE}; prefill " + ", ".join(
            f"{t:,}: {r:,.0f} tok/s" for t, r in SEED_PREFILL.items()) + " (TTFT 967 s at 982k)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.roofline_sparks", __doc__)
    ap.add_argument("--hardware", choices=sorted(HARDWARE), help="one machine (default: both, each with its recipe)")
    ap.add_argument("--recipe", help="weight recipe (default: gb10x2 the seed's exl3:4.0+w4a16, h200 the "
                    "committed whole model's exl3:2.5+fp8)")
    args = ap.parse_args(argv)
    runs = [(args.hardware, args.recipe)] if args.hardware else [("gb10x2", None), ("h200", None)]
    for hardware, recipe in runs:
        print(report(hardware, recipe or ("exl3:4.0+w4a16" if hardware == "gb10x2" else "exl3:2.5+fp8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
