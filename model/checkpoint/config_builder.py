"""`config.json` and `generation_config.json` for a tiny checkpoint, in the release's spellings.

The release config differs from what transformers' `save_pretrained` writes: MLA layers are spelled
`deepseek_sparse_attention` and the KDA sizes sit in a `linear_attn_config` dict rather than flat `linear_*` fields.
Loaders that only know the release (exllamav3) need these spellings; transformers and our ModelConfig read both.
"""

from __future__ import annotations

from typing import Any

from .spec import TinySpec


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def text_config(spec: TinySpec, *, pad_token_id: int, eos_token_ids: list[int]) -> dict[str, Any]:
    s = spec
    return {
        "model_type": "glm5_next_text",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_attention_heads,  # MLA: every head has its own K/V after kv_b_proj
        "q_lora_rank": s.q_lora_rank,
        "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim,
        "n_routed_experts": s.n_routed_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "n_shared_experts": s.n_shared_experts,
        "n_group": s.n_group,
        "topk_group": s.topk_group,
        "norm_topk_prob": s.norm_topk_prob,
        "routed_scaling_factor": s.routed_scaling_factor,
        "swiglu_limit": s.swiglu_limit,
        "hidden_act": "silu",
        "rms_norm_eps": s.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": s.max_position_embeddings,
        "index_topk": s.index_topk,
        "index_n_heads": s.index_n_heads,
        "index_head_dim": s.index_head_dim,
        "index_kpool": s.index_kpool,
        "index_kpool_always_select_tail": True,
        "hc_mult": s.hc_mult,
        "hc_eps": s.hc_eps,
        "hc_sinkhorn_iters": s.hc_sinkhorn_iters,
        "linear_attn_config": {
            "head_dim": s.linear_head_dim,
            "num_heads": s.linear_num_heads,
            "short_conv_kernel_size": s.linear_conv_kernel_dim,
            "gate_lower_bound": s.linear_lower_bound,
            "safe_gate": True,
        },
        "layer_types": list(s.layer_types),
        "indexer_types": list(s.indexer_types),
        "mlp_layer_types": list(s.mlp_layer_types),
        "num_nextn_predict_layers": s.num_nextn_predict_layers,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,  # GLM prompts start with [gMASK]<sop> from the chat template, not a BOS id
        "eos_token_id": list(eos_token_ids),
        "pad_token_id": pad_token_id,
    }


def vision_config(spec: TinySpec) -> dict[str, Any]:
    s = spec
    return {
        "model_type": "glm5_next_vision",
        "depth": s.vision_depth,
        "hidden_size": s.vision_hidden_size,
        "num_heads": s.vision_num_heads,
        "intermediate_size": s.vision_intermediate_size,
        "out_hidden_size": s.hidden_size,  # the merger projects straight into the text embedding space
        "projection_intermediate_size": s.vision_projection_intermediate_size,
        "patch_size": s.vision_patch_size,
        "image_size": s.vision_image_size,
        "spatial_merge_size": s.vision_spatial_merge_size,
        "temporal_patch_size": s.vision_temporal_patch_size,
        "in_channels": s.vision_in_channels,
        "hidden_act": "silu",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "swiglu_limit": s.swiglu_limit,
    }


def model_config(spec: TinySpec, *, token_ids: dict[str, int], pad_token_id: int, eos_token_ids: list[int],
                 dtype: str) -> dict[str, Any]:
    """The whole `config.json`: multimodal wrapper, text_config, vision_config, media token ids."""
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "dtype": dtype,
        "tie_word_embeddings": False,
        "image_token_id": token_ids["<|image|>"],
        "video_token_id": token_ids["<|video|>"],
        "image_start_token_id": token_ids["<|begin_of_image|>"],
        "image_end_token_id": token_ids["<|end_of_image|>"],
        "video_start_token_id": token_ids["<|begin_of_video|>"],
        "video_end_token_id": token_ids["<|end_of_video|>"],
        "text_config": text_config(spec, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids),
        "vision_config": vision_config(spec),
    }


def processor_config(spec: TinySpec) -> dict[str, Any]:
    """`processor_config.json`: the image processor's settings. exllamav3's GLM-5.3 loader reads it unconditionally
    (architecture/glm5_next.py: patch / temporal patch / merge sizes, mean and std, processor type, image token
    bounds); the mean and std are GLM-4V's (CLIP's)."""
    return {
        "image_processor": {
            "image_processor_type": "Glm5NextImageProcessor",
            "patch_size": spec.vision_patch_size,
            "temporal_patch_size": spec.vision_temporal_patch_size,
            "merge_size": spec.vision_spatial_merge_size,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "min_image_tokens": 4,
            "max_image_tokens": 1024,
        }
    }


def generation_config(*, pad_token_id: int, eos_token_ids: list[int]) -> dict[str, Any]:
    """Sampling defaults as GLM releases ship them."""
    return {
        "do_sample": True,
        "eos_token_id": list(eos_token_ids),
        "pad_token_id": pad_token_id,
        "temperature": 1.0,
        "top_p": 0.95,
    }


# The tiny checkpoint's images are small: 4..64 placeholder tokens each (the release allows 16..8,000).
TINY_MIN_IMAGE_TOKENS, TINY_MAX_IMAGE_TOKENS = 4, 64


def preprocessor_config(spec: TinySpec) -> dict[str, Any]:
    """`preprocessor_config.json`: GLM-5's image processor settings (transformers `Glm5NextImageProcessor`)."""
    s = spec
    return {
        "image_processor_type": "Glm5NextImageProcessor",
        "do_resize": True,
        "resample": 3,  # bicubic
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "patch_size": s.vision_patch_size,
        "temporal_patch_size": s.vision_temporal_patch_size,
        "merge_size": s.vision_spatial_merge_size,
        "min_image_tokens": TINY_MIN_IMAGE_TOKENS,
        "max_image_tokens": TINY_MAX_IMAGE_TOKENS,
    }
