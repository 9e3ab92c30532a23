"""Named size presets for `make-tiny`: TinySpec overrides chosen for one purpose.

- "default": spec.py's dimensions, the CPU test model (milliseconds per forward).
- "exl3": the default model with hidden 128 and MLPs 512 wide (EXL3_DIMS), the smallest at which its MLP linears
  are whole 128 x 128 EXL3 tiles on each of 4 virtual shards: what `make-tiny --format exl3` writes, and a dense
  model for `twinspark quantize --format exl3:BITS` (the default model, 64 wide, has no linear EXL3 can hold).
- "exllamav3": the smallest dimensions at which exllamav3 1.6.5 runs the *whole* glm5_next model through its own
  kernels, so a twinspark-written EXL3 checkpoint can be compared with twinspark as a model, not only per linear
  (tests/gpu/test_exl3_exllamav3_model.py). The comment on each size says which of its kernels or loaders sets the
  floor (read in its source; paths are inside the exllamav3 wheel); twinspark itself takes every dimension that
  divides into its 4 virtual shards, so the preset only has to satisfy exllamav3.
- "int": the default model with routed and shared experts 128 wide (INT_DIMS), the smallest at which every MLP
  linear, the experts' down_proj included, is whole groups of 32 (the smallest int3 group) on each of 4 virtual
  shards: what `make-tiny --format int3` (and int2 / int4 / int8) writes, and a dense model for `twinspark quantize
  --format int3` that packs every expert (the default model's experts are 32 wide, 8 per shard).

exllamav3's requirements that are not sizes: attention stays dense (KDA's q/k/v are stored unfused, which exllamav3
reads only as fp16; make-tiny's EXL3 layout anyway, see quantized.py), and every MLA layer runs a full indexer (the
default pattern): exllamav3 reads the k-pool tensors for shared-indexer layers too, which this layout
(transformers') stores on full layers only.
"""

from __future__ import annotations

from typing import Any

EXL3_DIMS: dict[str, Any] = dict(hidden_size=128, intermediate_size=512, moe_intermediate_size=512)  # 4 x 128
INT_DIMS: dict[str, Any] = dict(moe_intermediate_size=128)  # 4 x 32

EXLLAMAV3: dict[str, Any] = dict(
    # modules/linear.py pads every linear to a multiple of 128 (pad_to) and trims only some outputs: KDA's o_proj
    # writes its padded width into the residual, so the residual width must already be a multiple of 128.
    hidden_size=128,
    # EXL3 MLPs: 128-wide trellis tiles on each of twinspark's 4 virtual shards (as EXL3_DIMS).
    intermediate_size=512,
    moe_intermediate_size=512,
    # The query latent: not a kernel width, but 128 leaves modules/linear.py nothing to pad (q_a_proj's output,
    # q_b_proj's and the indexer's wq_b's input).
    q_lora_rank=128,
    # The cached latent: the MLA Triton kernels index it with one tl.arange (a power of two) and mla_absorb
    # launches kv_lora_rank // 128 programs per head (attention_fn/mla_triton.py), so 128 is the smallest.
    kv_lora_rank=128,
    # Per-head widths of the MHA-form prefill, the absorb and the unfold: tl.arange widths (powers of two) in tl.dot
    # tiles (>= 16); 64, the width twinspark's own GPU parity test runs (tests/gpu/test_cuda_parity.py).
    qk_nope_head_dim=64,
    v_head_dim=64,
    # KDA: the decode kernel takes per-channel decay only at 128 x 128 heads (exllamav3_ext/gdn.cu,
    # cuda_recurrent_gated_delta_rule: "channelwise decay (KDA) requires 128x128 head dims").
    linear_head_dim=128,
    # DSA indexer keys: a tl.arange width in the scoring kernels (attention_fn/dsa_triton.py), a power of two, in
    # tl.dot tiles (>= 16); 64 as above.
    index_head_dim=64,
    # A calm model: embeddings 16x (a power of two, exact in bf16) make every block's update small beside the
    # residual, as in trained models. At make-tiny's std 1.0 the random model is chaotic: a bf16 run of twinspark's
    # own reference agrees with fp32 on ~70% of top-1 tokens (8 layers, 256 tokens), so no fp16 implementation could
    # be checked by its top-1; at 16 it changes none that leads by more than 0.25 logits (measured on the CPU,
    # tests/model/test_make_tiny_exllamav3.py).
    embed_std=16.0,
)

PRESETS: dict[str, dict[str, Any]] = {"default": {}, "exl3": EXL3_DIMS, "exllamav3": EXLLAMAV3, "int": INT_DIMS}
