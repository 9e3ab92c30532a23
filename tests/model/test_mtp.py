"""The MTP block (layers.{L}) against an independent straightforward reference built from the same weights.

transformers has no MTP, so the reference is assembled here: transformers' own `Glm5NextTextAttention` (MLA + DSA
indexer, full-sequence, no cache) and `Glm5NextTextMoE` modules loaded with the MTP layer's weights, glued together
as DeepSeek-V3's MTP is defined: h = eh_proj(RMSNorm_e(embed(t_{i+1})) ++ RMSNorm_h(hidden_i)); h += attn(norm(h));
h += moe(norm(h)); logits = lm_head(shared_head.norm(h)). `hidden_i` is transformers' final (normed) hidden state
of the target model. Our runtime computes the same through its paged caches, in one prefill and in chunks.
"""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from model.batch import Batch
from tests.model.reference import BLOCK, fresh_cache, hf_model, our_model, random_ids

TOL = 1e-4


def _tensors(path, prefix: str) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for key, file in index.items():
        if key.startswith(prefix):
            with safe_open(path / file, "pt") as f:
                out[key[len(prefix):]] = f.get_tensor(key).float()
    return out


def _reference_mtp(path, ids: list[int]) -> torch.Tensor:
    from transformers.models.glm5_next import modeling_glm5_next as hf

    model = hf_model(path)
    tcfg = model.config.text_config
    layer = tcfg.num_hidden_layers
    w = _tensors(path, f"model.language_model.layers.{layer}.")
    full_mla = next(i for i, t in enumerate(tcfg.layer_types) if t != "linear_attention" and tcfg.indexer_types[i] == "full")
    attn = hf.Glm5NextTextAttention(tcfg, full_mla).eval()  # constructed as a full-indexer MLA layer
    attn.load_state_dict({k[len("self_attn."):]: v for k, v in w.items() if k.startswith("self_attn.")})
    moe = hf.Glm5NextTextMoE(tcfg).eval()
    experts = range(tcfg.n_routed_experts)
    moe.load_state_dict({
        "gate.weight": w["mlp.gate.weight"], "gate.e_score_correction_bias": w["mlp.gate.e_score_correction_bias"],
        "experts.gate_up_proj": torch.stack([torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"],
                                                        w[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts]),
        "experts.down_proj": torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in experts]),
        **{k[len("mlp."):]: v for k, v in w.items() if k.startswith("mlp.shared_experts.")},
    })

    def norm(x, key):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + tcfg.rms_norm_eps) * w[key]

    with torch.no_grad():
        text = model.model.language_model
        hidden = text(input_ids=torch.tensor([ids])).last_hidden_state  # [1, n, D], after the final norm
        emb = text.embed_tokens(torch.tensor([ids[1:]]))
        h = torch.cat([norm(emb, "enorm.weight"), norm(hidden[:, :-1], "hnorm.weight")], -1) @ w["eh_proj.weight"].T
        mask = torch.ones(1, h.shape[1], dtype=torch.bool)
        h = h + attn(norm(h, "input_layernorm.weight"), attention_mask=mask, past_key_values=None)[0]
        h = h + moe(norm(h, "post_attention_layernorm.weight"))
        return model.lm_head(norm(h, "shared_head.norm.weight"))[0]


def _ours(path, ids: list[int], chunks: list[int]) -> torch.Tensor:
    model = our_model(path)
    n = len(ids)
    target = model.forward(Batch.single(ids, 0, list(range(-(-n // BLOCK))), all_logits=True), fresh_cache(model, n))
    cache = fresh_cache(model, n)
    out, pos = [], 0
    for size in chunks:  # MTP rows i = pos..pos+size-1: next token ids[i+1], target hidden at i
        batch = Batch.single(ids[pos + 1 : pos + size + 1], pos, list(range(-(-n // BLOCK))), all_logits=True)
        batch.hidden = target.hidden[pos : pos + size]
        out.append(model.forward_mtp(batch, cache).logits)
        pos += size
    return torch.cat(out)


def test_mtp_matches_reference(tiny_sparse):
    ids = random_ids(81, seed=5)  # 80 MTP rows; index_topk 16 << 80 so the MTP indexer really selects
    ref = _reference_mtp(tiny_sparse, ids)
    for chunks in ([80], [33, 20, 1, 1, 25]):
        delta = (_ours(tiny_sparse, ids, chunks) - ref).abs().max().item()
        print(f"MTP chunks {chunks}: max |dlogits| = {delta:.2e}")
        assert delta <= TOL
