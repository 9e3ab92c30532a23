"""`make-tiny` writes a checkpoint every loader reads like the real GLM-5.3-Flash release.

transformers is only a reference here (dev dependency): it must load our files with no missing keys and run them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.config import MLA, ModelConfig
from model.checkpoint import cli as tiny_cli
from model.checkpoint import make_tiny, write_tiny
from model.checkpoint.tensor_spec import keeps_fp32
from model.checkpoint.tokenizer_builder import SPECIAL_TOKENS, TAG_TOKENS, chat_template_text
from tests.model.quant_helpers import read_tensors

REPO = Path(__file__).resolve().parents[2]
TEXT = "model.language_model."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="module")
def shared_ckpt(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "shared", layer_pattern="KKKMMKKM",
                     indexer_pattern="FFFFSFFF", dtype="float32")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


# ----- determinism -----

def test_same_seed_same_bytes_different_seed_different_weights(ckpt: Path, tmp_path: Path) -> None:
    again = make_tiny(tmp_path / "again", seed=0)
    a, b = _files(ckpt), _files(again)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], f"{name} differs between two runs with the same seed"

    other = make_tiny(tmp_path / "other", seed=1)
    assert (other / "tokenizer.json").read_bytes() == a["tokenizer.json"]  # tokenizer does not depend on the seed
    ta, to = read_tensors(ckpt), read_tensors(other)
    assert ta.keys() == to.keys()
    for key in (f"{TEXT}embed_tokens.weight", f"{TEXT}layers.3.self_attn.q_b_proj.weight", "lm_head.weight"):
        assert not torch.equal(ta[key], to[key]), key


def test_values_do_not_depend_on_dtype_except_rounding(ckpt: Path, shared_ckpt: Path) -> None:
    # Keys present in both (seed 0): the per-key generator makes values independent of dtype and of layer pattern.
    bf, fp = read_tensors(ckpt), read_tensors(shared_ckpt)
    for key in (f"{TEXT}layers.0.self_attn.q_proj.weight", f"{TEXT}layers.3.self_attn.indexer.wq_b.weight",
                f"{TEXT}layers.3.mlp.experts.5.down_proj.weight", "lm_head.weight"):
        assert bf[key].dtype == torch.bfloat16 and fp[key].dtype == torch.float32
        assert torch.equal(bf[key], fp[key].to(torch.bfloat16)), key
    assert torch.equal(bf[f"{TEXT}layers.0.self_attn.dt_bias"], fp[f"{TEXT}layers.0.self_attn.dt_bias"])


# ----- config -----

def test_model_config_reads_it(ckpt: Path) -> None:
    cfg = ModelConfig.from_pretrained(ckpt)
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert cfg.num_hidden_layers == 8 and cfg.hidden_size == 64 and cfg.vocab_size == 1088
    assert cfg.mla_layers == [3, 7] and cfg.kda_layers == [0, 1, 2, 4, 5, 6]
    assert cfg.indexer_types == ("full",) * 8
    assert cfg.mlp_layer_types == ("dense",) + ("sparse",) * 7
    assert cfg.eos_token_id == (ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"])
    assert cfg.pad_token_id == ids["<|endoftext|>"]
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim, cfg.linear_lower_bound) == (4, 16, 4, -5.0)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool, cfg.index_topk) == (16, 16, 4, 64)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (8, 2, 1)
    assert cfg.mtp_layer_index == 8 and cfg.num_nextn_predict_layers == 1
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tok["model"]["vocab"]) + len(tok["added_tokens"])


def test_config_uses_release_spellings(ckpt: Path) -> None:
    raw = _config(ckpt)
    text = raw["text_config"]
    assert raw["architectures"] == ["Glm5NextForConditionalGeneration"] and raw["model_type"] == "glm5_next"
    assert raw["dtype"] == "bfloat16" and raw["tie_word_embeddings"] is False
    assert text["model_type"] == "glm5_next_text"
    assert set(text["layer_types"]) == {"linear_attention", MLA}
    assert not any(k.startswith("linear_") and k != "linear_attn_config" for k in text)
    assert text["linear_attn_config"] == {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                          "gate_lower_bound": -5.0, "safe_gate": True}
    assert text["bos_token_id"] is None
    ids = {t["content"]: t["id"] for t in json.loads((ckpt / "tokenizer.json").read_text())["added_tokens"]}
    for field, token in (("image_token_id", "<|image|>"), ("video_token_id", "<|video|>"),
                         ("image_start_token_id", "<|begin_of_image|>"), ("image_end_token_id", "<|end_of_image|>"),
                         ("video_start_token_id", "<|begin_of_video|>"), ("video_end_token_id", "<|end_of_video|>")):
        assert raw[field] == ids[token], field
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == text["eos_token_id"] and gen["pad_token_id"] == text["pad_token_id"]
    assert gen["do_sample"] is True and gen["top_p"] == 0.95
    assert raw["vision_config"]["out_hidden_size"] == text["hidden_size"]


# ----- weights -----

def test_shards_and_index(ckpt: Path) -> None:
    shards = sorted(ckpt.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    held = {}
    total = 0
    for f in shards:
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                held[k] = f.name
                t = s.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == held
    assert index["metadata"]["total_size"] == total


def test_key_layout_and_storage_dtypes(ckpt: Path) -> None:
    t = read_tensors(ckpt)
    for k, v in t.items():
        assert v.dtype == (torch.float32 if keeps_fp32(k) else torch.bfloat16), k
    L = f"{TEXT}layers."
    # KDA layer 0 (dense FFN), MLA layer 3 (MoE)
    assert t[L + "0.self_attn.q_conv1d.weight"].shape == (64, 1, 4)
    assert t[L + "0.self_attn.f_b_proj.weight"].shape == (64, 16) and t[L + "0.self_attn.A_log"].shape == (4,)
    assert t[L + "0.mlp.gate_proj.weight"].shape == (128, 64)
    assert t[L + "0.hc_attn_fn"].shape == (24, 256) and t[L + "0.hc_ffn_scale"].dtype == torch.float32
    assert t[L + "3.self_attn.kv_b_proj.weight"].shape == (4 * 32, 32)
    assert t[L + "3.self_attn.indexer.index_kpool_compress_ape"].shape == (4, 16)
    assert (t[L + "3.self_attn.indexer.weights_proj.weight"] >= 0).all()
    assert t[L + "3.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert t[L + "3.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # MTP block after the last layer: eh_proj + full MLA/indexer + MoE, and no mHC
    mtp = {k for k in t if k.startswith(L + "8.")}
    assert {L + "8.eh_proj.weight", L + "8.enorm.weight", L + "8.hnorm.weight", L + "8.shared_head.norm.weight",
            L + "8.self_attn.indexer.wk.weight", L + "8.mlp.experts.0.gate_proj.weight"} <= mtp
    assert t[L + "8.eh_proj.weight"].shape == (64, 128)
    assert not any(".hc_" in k for k in mtp)
    assert not any(k.startswith(L + "9.") for k in t)
    assert any(k.startswith("model.visual.blocks.0.") for k in t)


def test_layer_and_indexer_patterns(shared_ckpt: Path) -> None:
    t = read_tensors(shared_ckpt)
    assert all(v.dtype == torch.float32 for v in t.values())
    L = f"{TEXT}layers."
    assert L + "4.self_attn.q_a_proj.weight" in t  # layer 4 is MLA ...
    assert not any(k.startswith(L + "4.self_attn.indexer.") for k in t)  # ... sharing layer 3's selection
    assert L + "3.self_attn.indexer.wq_b.weight" in t and L + "7.self_attn.indexer.wq_b.weight" in t
    cfg = ModelConfig.from_pretrained(shared_ckpt)
    assert cfg.mla_layers == [3, 4, 7]
    assert cfg.indexer_types[4] == "shared" and cfg.full_indexer_layer(4) == 3
    assert _config(shared_ckpt)["dtype"] == "float32"


@pytest.mark.parametrize("kwargs", [
    {"layer_pattern": "KKM"},  # wrong length
    {"layer_pattern": "KKKXKKKM"},  # bad letter
    {"indexer_pattern": "FFFSFFFF"},  # layer 3, the first MLA layer, shares: no earlier full layer to share from
    {"index_topk": 62},  # not a multiple of the k-pool size
    {"experts": 1},  # fewer than top-2
])
def test_bad_options_raise(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_tiny(tmp_path / "bad", **kwargs)


# ----- transformers reference -----

def _hf_load(d: Path):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Glm5NextForConditionalGeneration.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("which", ["ckpt", "shared_ckpt"])
def test_transformers_loads_and_runs(which: str, request) -> None:
    d = request.getfixturevalue(which)
    model, info = _hf_load(d)
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    mtp = re.compile(rf"^{re.escape(TEXT)}layers\.8\.")
    assert info["unexpected_keys"] and all(mtp.match(k) for k in info["unexpected_keys"])
    assert model.config.text_config.linear_num_heads == 4
    n = 40
    ids = torch.randint(0, 1026, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, n, 1088)
    assert torch.isfinite(logits).all()
    # Healthy spread: greedy decoding must not hinge on tiny differences.
    top2 = logits[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 1e-2


# ----- tokenizer -----

@pytest.fixture(scope="module")
def tok(ckpt: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Café naïve résumé, 中文字符, 日本語, emoji 🙂🚀 and a rare one 🦩.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tok, text: str) -> None:
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_added_tokens_are_single_ids(tok) -> None:
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        enc = tok.encode(f"a{t}b")
        assert tok.token_to_id(t) in enc.ids and len(enc.ids) == 3, t
    # tags stay in decoded text, control tokens do not
    ids = tok.encode("<|assistant|><think>hm</think>ok").ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>hm</think>ok"


def test_autotokenizer_agrees(ckpt: Path, tok) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert hf.eos_token == "<|endoftext|>" and hf.pad_token_id == tok.token_to_id("<|endoftext|>")
    for text in TEXTS + ["[gMASK]<sop><|user|>\nhi<|assistant|><think>"]:
        assert hf.encode(text, add_special_tokens=True) == tok.encode(text).ids
    assert "chat_template" not in json.loads((ckpt / "tokenizer_config.json").read_text())
    assert hf.chat_template == (ckpt / "chat_template.jinja").read_text()


# ----- chat template -----

def _render(**kw) -> str:
    # The same environment shape transformers and our gateway use: sandboxed, tojson without HTML escaping.
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **k: json.dumps(x, ensure_ascii=False, **k)
    return env.from_string(chat_template_text()).render(**kw)


def test_chat_system_user_generation_prompt() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _render(messages=msgs, add_generation_prompt=True) == \
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|><think>"
    assert _render(messages=msgs, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|user|>\nHi<|assistant|><think></think>")
    assert _render(messages=msgs).endswith("<|user|>\nHi")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Paris", "days": 2, "hourly": True}}}]},
    {"role": "tool", "content": "18C, light rain"},
    {"role": "assistant", "content": "It is 18C with light rain.", "reasoning_content": "Report it."},
    {"role": "user", "content": "Thanks!"},
]


def test_chat_tools_calls_and_results() -> None:
    out = _render(messages=TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    assert out.startswith("[gMASK]<sop><|system|>\n")
    assert '"name": "get_weather"' in out and "<tools>" in out and "<tool_call>FUNCTION_NAME<arg_key>" in out
    assert "<|user|>\nWeather in Paris?<|assistant|><think>I should call the tool.</think>\n" in out
    assert ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value><arg_key>hourly</arg_key><arg_value>true</arg_value>"
            "</tool_call>") in out
    assert "<|observation|>\n<tool_response>18C, light rain</tool_response><|assistant|>" in out
    assert "<|assistant|><think>Report it.</think>\nIt is 18C with light rain.<|user|>\nThanks!" in out
    assert out.endswith("<|assistant|><think>")


def test_chat_clear_thinking_and_json_string_arguments() -> None:
    out = _render(messages=TOOL_CHAT, tools=TOOLS, clear_thinking=True)
    assert "I should call the tool." not in out and "Report it." not in out
    assert "<|assistant|><think></think>\nIt is 18C" in out
    # reasoning after the last user message (the turn in progress) is kept even with clear_thinking
    in_progress = TOOL_CHAT[:3]
    assert "I should call the tool." in _render(messages=in_progress, clear_thinking=True)
    # arguments as a JSON string: parsed when the renderer passes a JSON loader
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1, "b": "s"}'}}]}]
    assert "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>s</arg_value>" \
           "</tool_call>" in _render(messages=msgs, from_json=json.loads)


def test_chat_template_through_transformers(ckpt: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    out = hf.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert out == _render(messages=TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)


# ----- CLI -----

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twinspark")
    tiny_cli.register(p.add_subparsers(dest="command"))
    return p


def test_cli_help_and_run(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["make-tiny", "--help"])
    assert e.value.code == 0
    assert "--layer-pattern" in capsys.readouterr().out
    args = _parser().parse_args(["make-tiny", "--out", str(tmp_path / "c"), "--layers", "4", "--experts", "4",
                                 "--index-topk", "16", "--dtype", "float32"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "params" in out and "config.json" in out and "model.safetensors.index.json" in out
    cfg = ModelConfig.from_pretrained(tmp_path / "c")
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.index_topk) == (4, 4, 16)
    bad = _parser().parse_args(["make-tiny", "--out", str(tmp_path / "d"), "--layer-pattern", "KM"])
    assert bad.func(bad) == 2


def test_twinspark_entry_point(tmp_path: Path) -> None:
    pytest.importorskip("services.rank_worker.generate_cli")
    r = subprocess.run([sys.executable, "-m", "services.cli", "make-tiny", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--index-topk" in r.stdout
    from services.cli import main
    assert main(["make-tiny", "--out", str(tmp_path / "e"), "--seed", "2"]) == 0
    assert (tmp_path / "e" / "model.safetensors.index.json").exists()


def test_write_tiny_reports(tmp_path: Path) -> None:
    ck = write_tiny(tmp_path / "w", progress=False)
    assert ck.num_params > ck.num_text_params > 0
    assert {p.name for p in ck.files} == {p.name for p in (tmp_path / "w").iterdir()}
