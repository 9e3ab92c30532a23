"""Train the tiny checkpoint's tokenizer: a small byte-level BPE plus GLM's special and tag tokens.

Byte-level BPE (like GLM's own tokenizer) can encode any UTF-8 text, so tests can send unicode and emoji without
unknown tokens. Training runs offline on the embedded corpus and is deterministic: the BPE trainer breaks count
ties by pair order, so the same corpus gives the same `tokenizer.json` bytes on every run and machine.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import CORPUS

# Target size of the learned vocabulary (256 byte tokens + merges), before the added tokens.
BPE_VOCAB_SIZE = 1000

# GLM's control tokens, in GLM's order. They are "special": never split, skipped by skip_special_tokens.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)

# Reasoning/tool tags: single ids like the specials, but not special, so decoding (even with
# skip_special_tokens) keeps them in the text where the reasoning and tool-call parsers look for them.
TAG_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
# Ids that end an assistant turn: end of text, or the model handing the turn to the user or a tool.
STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")

MODEL_MAX_LENGTH = 1048576


def build_tokenizer() -> Tokenizer:
    """Train the BPE on the embedded corpus and append the added tokens (so their ids follow the learned vocab)."""
    tok = Tokenizer(models.BPE())
    # No prefix space: GLM does not insert one, and it keeps encode(decode(x)) == x for text that starts a prompt.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        # Every byte gets a token even if the corpus lacks it, so no input is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


def token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of every added token, by text; the config's special-token ids come from here."""
    ids = {}
    for t in SPECIAL_TOKENS + TAG_TOKENS:
        i = tok.token_to_id(t)
        if i is None:  # cannot happen unless the added-token lists above are broken
            raise RuntimeError(f"added token {t!r} has no id")
        ids[t] = i
    return ids


def tokenizer_config(tok: Tokenizer) -> dict:
    """`tokenizer_config.json`: the fast tokenizer class and its named tokens; the chat template lives in its own file."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + TAG_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "eos_token": EOS_TOKEN,
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "padding_side": "left",
        "remove_space": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_tokenizer(tok: Tokenizer, out_dir: Path) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja; returns the paths written."""
    out_dir = Path(out_dir)
    tok_path = out_dir / "tokenizer.json"
    tok.save(str(tok_path), pretty=True)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(tokenizer_config(tok), indent=2, ensure_ascii=False) + "\n")
    tmpl_path = out_dir / "chat_template.jinja"
    tmpl_path.write_text(chat_template_text())
    return [tok_path, cfg_path, tmpl_path]


def chat_template_text() -> str:
    """The GLM-style chat template shipped next to this module."""
    return (Path(__file__).with_name("chat_template.jinja")).read_text()
