"""Every text-model tensor of a tiny GLM-5.3-Flash, under the release's key names.

Key names are those of the release / transformers 5.23 `save_pretrained` (per-expert `experts.{e}.*`, split
`q/k/v_conv1d`, flat `hc_attn_*` / `hc_ffn_*`, KDA gate tensors directly under `self_attn`), plus the MTP block at
`layers.{num_hidden_layers}` that transformers drops but our drafter path loads.

Initialisation aims for a *useful* random model rather than a trained-looking one: activations stay O(1) through the
stack and the logits have a wide spread, so greedy decoding does not flip on 1e-6 numeric noise and the router,
indexer and mHC all make input-dependent, non-degenerate choices.
"""

from __future__ import annotations

import math

from .spec import KDA, TinySpec
from .tensor_spec import BIAS, NORM, Init, TensorSpec, fan_in, normal
from .vision_weights import vision_tensors

TEXT = "model.language_model."

# lm_head std = LM_HEAD_GAIN / sqrt(H). The final RMSNorm makes h ~ unit scale, so logits ~ N(0, LM_HEAD_GAIN^2):
# with 1088 rows, a gain of 4 gives typical top-1/top-2 gaps of ~0.1-1, far above float noise.
LM_HEAD_GAIN = 4.0


def _t(key: str, shape: tuple[int, ...], init: Init) -> TensorSpec:
    return TensorSpec(key, shape, init)


def _linear(key: str, out_features: int, in_features: int) -> TensorSpec:
    return _t(key + ".weight", (out_features, in_features), fan_in(in_features))


def _norm(key: str, n: int) -> TensorSpec:
    return _t(key + ".weight", (n,), NORM)


def hyper_connection(p: str, s: TinySpec, which: str) -> list[TensorSpec]:
    """mHC projection for one sub-block: (pre, post, comb) = (hc + hc + hc*hc) outputs from the hc*H flat streams."""
    n_out = (2 + s.hc_mult) * s.hc_mult
    return [
        # fan-in scale (its input is RMS-normalised) so pre/post/comb logits are O(1) and vary per token.
        _t(f"{p}hc_{which}_fn", (n_out, s.hc_mult * s.hidden_size), fan_in(s.hc_mult * s.hidden_size)),
        _t(f"{p}hc_{which}_base", (n_out,), normal(0.1)),
        _t(f"{p}hc_{which}_scale", (3,), NORM),
    ]


def kda_attention(p: str, s: TinySpec) -> list[TensorSpec]:
    """Kimi delta attention: q/k/v with short convs, low-rank forget gate, beta, low-rank output gate, gated norm."""
    a = p + "self_attn."
    H, dl = s.hidden_size, s.linear_head_dim
    qkv = s.linear_num_heads * dl
    return [
        _linear(a + "q_proj", qkv, H),
        _linear(a + "k_proj", qkv, H),
        _linear(a + "v_proj", qkv, H),
        _t(a + "q_conv1d.weight", (qkv, 1, s.linear_conv_kernel_dim), Init("uniform", -0.5, 0.5)),
        _t(a + "k_conv1d.weight", (qkv, 1, s.linear_conv_kernel_dim), Init("uniform", -0.5, 0.5)),
        _t(a + "v_conv1d.weight", (qkv, 1, s.linear_conv_kernel_dim), Init("uniform", -0.5, 0.5)),
        _linear(a + "f_a_proj", dl, H),
        _linear(a + "f_b_proj", qkv, dl),
        _t(a + "dt_bias", (qkv,), Init("dt_bias")),
        _t(a + "A_log", (s.linear_num_heads,), normal(0.1)),
        _linear(a + "b_proj", s.linear_num_heads, H),
        _linear(a + "g_a_proj", dl, H),
        _linear(a + "g_b_proj", qkv, dl),
        _norm(a + "o_norm", dl),
        _linear(a + "o_proj", H, qkv),
    ]


def mla_attention(p: str, s: TinySpec, *, indexer: bool) -> list[TensorSpec]:
    """NoPE MLA (low-rank q and kv) and, for a "full" indexer layer, its DSA lightning indexer."""
    a = p + "self_attn."
    H = s.hidden_size
    qk = s.qk_nope_head_dim + s.qk_rope_head_dim
    t = [
        _linear(a + "q_a_proj", s.q_lora_rank, H),
        _norm(a + "q_a_layernorm", s.q_lora_rank),
        _linear(a + "q_b_proj", s.num_attention_heads * qk, s.q_lora_rank),
        _linear(a + "kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, H),
        _norm(a + "kv_a_layernorm", s.kv_lora_rank),
        _linear(a + "kv_b_proj", s.num_attention_heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
        _linear(a + "o_proj", H, s.num_attention_heads * s.v_head_dim),
    ]
    if indexer:
        i = a + "indexer."
        t += [
            _linear(i + "wq_b", s.index_n_heads * s.index_head_dim, s.q_lora_rank),
            _linear(i + "wk", s.index_head_dim, H),
            _norm(i + "k_norm", s.index_head_dim),
            _t(i + "k_norm.bias", (s.index_head_dim,), BIAS),
            # Positive per-head weights: with several heads the weighted ReLU scores rarely cancel to exactly 0,
            # so top-k selection has few ties and does not depend on tie-breaking order.
            _t(i + "weights_proj.weight", (s.index_n_heads, H), Init("abs_normal", 1.0 / math.sqrt(H))),
            _t(i + "index_kpool_compress_ape", (s.index_kpool, s.index_head_dim), normal(0.1)),
            _t(i + "index_kpool_compress_gate", (s.index_head_dim, H), fan_in(H)),
        ]
    return t


def dense_mlp(p: str, s: TinySpec) -> list[TensorSpec]:
    m, H, inter = p + "mlp.", s.hidden_size, s.intermediate_size
    return [_linear(m + "gate_proj", inter, H), _linear(m + "up_proj", inter, H), _linear(m + "down_proj", H, inter)]


def moe_mlp(p: str, s: TinySpec) -> list[TensorSpec]:
    """Sigmoid router with a noaux_tc correction bias, routed experts, and the always-on shared expert(s)."""
    m, H, im, E = p + "mlp.", s.hidden_size, s.moe_intermediate_size, s.n_routed_experts
    t = [
        _t(m + "gate.weight", (E, H), fan_in(H)),
        _t(m + "gate.e_score_correction_bias", (E,), normal(0.01)),
    ]
    for e in range(E):
        x = f"{m}experts.{e}."
        t += [_linear(x + "gate_proj", im, H), _linear(x + "up_proj", im, H), _linear(x + "down_proj", H, im)]
    ims = im * s.n_shared_experts
    x = m + "shared_experts."
    t += [_linear(x + "gate_proj", ims, H), _linear(x + "up_proj", ims, H), _linear(x + "down_proj", H, ims)]
    return t


def decoder_layer(i: int, s: TinySpec) -> list[TensorSpec]:
    p = f"{TEXT}layers.{i}."
    if s.layer_types[i] == KDA:
        attn = kda_attention(p, s)
    else:
        attn = mla_attention(p, s, indexer=s.indexer_types[i] == "full")
    mlp = dense_mlp(p, s) if s.mlp_layer_types[i] == "dense" else moe_mlp(p, s)
    return (hyper_connection(p, s, "attn") + [_norm(p + "input_layernorm", s.hidden_size)] + attn
            + hyper_connection(p, s, "ffn") + [_norm(p + "post_attention_layernorm", s.hidden_size)] + mlp)


def mtp_layer(s: TinySpec, j: int = 0) -> list[TensorSpec]:
    """DeepSeek-V3-style MTP block: norm(embed) ‖ norm(hidden) -> eh_proj -> MLA+DSA+MoE block (no mHC) -> norm.

    It reuses the target's embed_tokens and lm_head, so it stores neither.
    """
    p = f"{TEXT}layers.{s.mtp_layer_index + j}."
    H = s.hidden_size
    return ([_norm(p + "enorm", H), _norm(p + "hnorm", H), _linear(p + "eh_proj", H, 2 * H),
             _norm(p + "input_layernorm", H)] + mla_attention(p, s, indexer=True)
            + [_norm(p + "post_attention_layernorm", H)] + moe_mlp(p, s) + [_norm(p + "shared_head.norm", H)])


def all_tensors(s: TinySpec) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in a fixed order (model order: embeddings, layers, MTP, head, vision)."""
    if s.vocab_size <= 0:
        raise ValueError("vocab_size must be set (from the tokenizer) before listing tensors")
    H = s.hidden_size
    t = [_t(TEXT + "embed_tokens.weight", (s.vocab_size, H), normal(s.embed_std))]
    for i in range(s.num_hidden_layers):
        t += decoder_layer(i, s)
    for j in range(s.num_nextn_predict_layers):
        t += mtp_layer(s, j)
    t += [_norm(TEXT + "norm", H), _t("lm_head.weight", (s.vocab_size, H), normal(LM_HEAD_GAIN / math.sqrt(H)))]
    t += vision_tensors(s)
    keys = [x.key for x in t]
    if len(set(keys)) != len(keys):  # guards the generator itself: a duplicate would silently overwrite in a shard
        raise RuntimeError("duplicate tensor keys in the tiny checkpoint spec")
    return t
