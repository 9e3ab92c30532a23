"""The vision tower's tensors (`model.visual.*`).

The tiny checkpoint carries a one-block tower: transformers always builds one (and reports missing keys without
it), and the rank runs it for image inputs (model/vision.py). The key list was taken once from transformers 5.23's
`Glm5NextVisionModel` built with the tiny vision_config and is hard-coded here (make-tiny must not import
transformers); the test that loads the checkpoint through transformers catches any drift.
"""

from __future__ import annotations

from .spec import TinySpec
from .tensor_spec import BIAS, NORM, Init, TensorSpec, normal

PREFIX = "model.visual."
# Large enough that image embeddings come out at the scale of the text embeddings (std 1): a parity test against
# transformers then checks the image really conditions the logits.
_W = normal(0.25)


def vision_tensors(spec: TinySpec) -> list[TensorSpec]:
    s = spec
    vh = s.vision_hidden_size
    head_dim = vh // s.vision_num_heads
    vi = s.vision_intermediate_size
    out = s.hidden_size  # out_hidden_size: the merger writes text-embedding-sized vectors
    pi = s.vision_projection_intermediate_size
    m = s.vision_spatial_merge_size
    t: list[tuple[str, tuple[int, ...], Init]] = [
        ("patch_embed.proj.weight", (vh, s.vision_in_channels, s.vision_temporal_patch_size, s.vision_patch_size,
                                     s.vision_patch_size), _W),
        ("patch_embed.proj.bias", (vh,), BIAS),
    ]
    for d in range(s.vision_depth):
        b = f"blocks.{d}."
        t += [
            (b + "norm1.weight", (vh,), NORM),
            (b + "norm2.weight", (vh,), NORM),
            (b + "attn.qkv.weight", (3 * vh, vh), _W),
            (b + "attn.qkv.bias", (3 * vh,), BIAS),
            (b + "attn.proj.weight", (vh, vh), _W),
            (b + "attn.proj.bias", (vh,), BIAS),
            (b + "attn.q_norm.weight", (head_dim,), NORM),
            (b + "attn.k_norm.weight", (head_dim,), NORM),
            (b + "mlp.gate_proj.weight", (vi, vh), _W),
            (b + "mlp.gate_proj.bias", (vi,), BIAS),
            (b + "mlp.up_proj.weight", (vi, vh), _W),
            (b + "mlp.up_proj.bias", (vi,), BIAS),
            (b + "mlp.down_proj.weight", (vh, vi), _W),
            (b + "mlp.down_proj.bias", (vh,), BIAS),
        ]
    t += [
        ("post_layernorm.weight", (vh,), NORM),
        ("downsample.weight", (out, vh, m, m), _W),
        ("downsample.bias", (out,), BIAS),
        ("merger.proj.weight", (out, out), _W),
        ("merger.post_projection_norm.weight", (out,), NORM),
        ("merger.post_projection_norm.bias", (out,), BIAS),
        ("merger.gate_proj.weight", (pi, out), _W),
        ("merger.up_proj.weight", (pi, out), _W),
        ("merger.down_proj.weight", (out, pi), _W),
    ]
    return [TensorSpec(PREFIX + k, shape, init) for k, shape, init in t]
