"""Grammar mask cost per token at GLM-5.3-Flash's vocabulary size (154,880): llguidance vs xgrammar.

    python -m bench.grammar_mask --out bench/results [--vocab 154880] [--docs 20]

The vocabulary is a byte-level BPE built here, offline and deterministically: the 256 byte tokens, GLM's tag
tokens as added tokens, and merges of English-like letter runs, digits, punctuation, JSON fragments and CJK
characters (3 UTF-8 bytes) up to the target size. Each library compiles the same JSON schema and walks the same
valid documents token by token (their own canonical tokenization under llguidance's tokenizer), computing the full
bitmask before every token: the figure is the mask time per token (median, p90, max) plus the grammar compile time.
xgrammar is optional (`pip install xgrammar`; it brings triton and needs transformers): without it only
llguidance is measured.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

from bench import flags
from bench.stats import percentile

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                                      "zip": {"type": "string",
                                                                              "pattern": "^[0-9]{5}$"}},
                                     "required": ["city", "zip"]}}}
TAGS = ["<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
        "<arg_value>", "</arg_value>"]


def build_tokenizer_json(vocab: int, seed: int = 0) -> str:
    """tokenizer.json text of a byte-level BPE with `vocab` ids in total (added tags included)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_char = {}  # byte -> its printable stand-in, in GPT-2's order
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = 0
    for b in range(256):
        byte_char[b] = chr(b) if b in printable else chr(256 + extra)
        extra += b not in printable
    assert set(byte_char.values()) == set(alphabet)
    rng = random.Random(seed)
    toks = {byte_char[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    pieces = [byte_char[ord(" ")] + c for c in letters] + list(letters) + list("0123456789") + \
        [byte_char[ord(c)] for c in '{}[]":,.-_']
    cjk = ["".join(byte_char[b] for b in chr(cp).encode()) for cp in range(0x4E00, 0x4E00 + 6000)]

    def add(a: str, b: str) -> None:
        if a in toks and b in toks and a + b not in toks:
            toks[a + b] = len(toks)
            merges.append((a, b))

    for piece in pieces:  # make the seed pieces tokens first
        for i in range(1, len(piece)):
            add(piece[:i], piece[i])
    for c in cjk[:3000]:
        add(c[:2], c[2]) if c[:2] in toks else (add(c[0], c[1]), add(c[:2], c[2]))
    keys = list(toks)
    target = vocab - len(TAGS)
    while len(toks) < target:
        a = rng.choice(keys[-20000:] if rng.random() < 0.7 else keys)
        b = rng.choice(pieces)
        if len(a) + len(b) <= 16:
            before = len(toks)
            add(a, b)
            if len(toks) > before:
                keys.append(a + b)
    tok = Tokenizer(models.BPE(vocab=toks, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in TAGS[:1]])
    tok.add_tokens([AddedToken(t, special=False) for t in TAGS[1:]])
    return tok.to_str()


def documents(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "paris", "berlin", "tokyo", "国家", "数据", "model"]
    return [json.dumps({"name": " ".join(rng.choices(words, k=3)), "age": rng.randrange(100),
                        "tags": rng.choices(words, k=rng.randrange(1, 5)),
                        "address": {"city": rng.choice(words), "zip": f"{rng.randrange(10**5):05d}"}},
                       ensure_ascii=False, separators=(", ", ": ")) for _ in range(n)]


def bench_llguidance(tok_json: str, vocab: int, docs: list[str]) -> dict:
    from llguidance import LLMatcher, LLTokenizer

    tok = LLTokenizer(tok_json, n_vocab=vocab, eos_token=0)
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False,
                                                                   "item_separator": ", ", "key_separator": ": "})
    times, compile_s, encoded = [], [], []
    for doc in docs:
        t0 = time.perf_counter()
        m = LLMatcher(tok, grammar, log_level=0)
        compile_s.append(time.perf_counter() - t0)
        ids = tok.tokenize_str(doc)
        encoded.append(ids)
        for t in ids:
            t0 = time.perf_counter()
            m.compute_bitmask()
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), m.get_error()
        assert m.is_accepting()
    return _summary("llguidance", times, compile_s) | {"_ids": encoded}


def bench_xgrammar(tok_json: str, vocab: int, encoded: list[list[int]]) -> dict | None:
    try:
        import torch
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(tok_json))
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                              separators=(", ", ": "))
    first_compile = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for ids in encoded:
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            if not m.accept_token(t):
                break
    del torch
    return _summary("xgrammar", times, [first_compile])


def _summary(name: str, times: list[float], compile_s: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {"library": name, "tokens": len(us), "mask_us_median": round(statistics.median(us), 1),
            "mask_us_p90": round(percentile(us, 0.9), 1), "mask_us_max": round(us[-1], 1),
            "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.grammar_mask", __doc__)
    ap.add_argument("--vocab", type=int, default=154_880)
    ap.add_argument("--docs", type=int, default=20)
    flags.add(ap, flags.OUT, "write grammar_mask.json there (default: print only)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tok_json = build_tokenizer_json(args.vocab)
    print(f"tokenizer: {args.vocab} ids built in {time.perf_counter() - t0:.1f} s")
    docs = documents(args.docs)
    rows = [bench_llguidance(tok_json, args.vocab, docs)]
    encoded = rows[0].pop("_ids")
    xg = bench_xgrammar(tok_json, args.vocab, encoded)
    rows += [xg] if xg else []
    for r in rows:
        print(json.dumps(r))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grammar_mask.json").write_text(json.dumps({"vocab": args.vocab, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
