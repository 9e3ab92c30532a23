"""exllamav3 1.6.5 runs an EXL3 checkpoint written by twinspark as a whole model and agrees with twinspark on the
top-1 token at every decisive position (issue 10, Done-when 2).

The checkpoint and prompt are tests/model/test_make_tiny_exllamav3.py's (LAYOUT, prompt_ids), checked on the CPU
there: `make-tiny --format exl3 --preset exllamav3` (model/checkpoint/presets.py: the smallest dims exllamav3's kernels take, a
calm init), 4 layers KKKM (3 KDA, 1 MLA with its DSA indexer), a dense FFN then MoE (8 experts, top-2, a shared
expert), 4-bit EXL3 MLPs (mul1), 16-bit attention; 128 random ids below the special tokens, so the indexer
(index_topk 64, k-pools of 4) really selects past position 64.

The reference is twinspark's CPU twin in fp32 on the same EXL3 weights (dequantized by its torch reference). Every
comparison goes through `compare_top1` (same module, which derives the bound and checks a bf16 run against it): top-1
equal at every position where the reference's top-1 leads its runner-up by more than DECISIVE_GAP = 0.25 logits, at
least half the positions decisive; with -s it prints the reference margins, |d logits| per position, the decisive
count and every position whose top-1 differs. Compared with the reference:
- exllamav3 as its own examples drive it: Config.from_directory -> Model.from_config -> Cache -> model.load ->
  model.forward over the whole prompt (paged cache, `batch_shape` / `past_len`), logits of every position;
- exllamav3 without a cache (`attn_mode` flash_attn_nc, its calibration path: no recurrent state, fp32 indexer
  scores);
- exllamav3 decoding: 96 prompt tokens, then the other 32 one forward each (teacher-forced), so its decode paths run
  too (KDA's recurrent step, DSA selection for one query, the MoE's single-row path);
- twinspark's own fused path (bf16, EXL3 experts packed), for scale.
Also: exllamav3 loads exactly the checkpoint's EXL3 linears as EXL3 (the rest fp16), and its tokenizer encodes a
chat prompt as twinspark's does from the same tokenizer files.

The layout has full indexers only: exllamav3 reads index_kpool_compress_ape / _gate for every MLA layer of a k-pool
model, shared-indexer layers included (modules/mla_attn.py load_local), and twinspark's layout (transformers') stores
them on full layers only, so a shared layer stops its load.

exllamav3 is imported inside a fixture (importing it loads its CUDA extension); without CUDA, or when that import
fails, the tests skip saying why. Anything that fails after the import is a failure. Install on the GPU host:
`source <kit>/install.sh exllamav3` (../shared/device/README.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from model.model import Glm5Model
from model.checkpoint import make_tiny
from tests.model.quant_helpers import read_tensors
from tests.model.test_make_tiny_exllamav3 import LAYOUT, PROMPT, compare_top1, prefill_logits, prompt_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = torch.device("cuda", 0)
PAGE = 256  # exllamav3's cache page (constants.PAGE_SIZE): the cache is one page, the prompt fits in it
PREFILL = 96  # the decode test's prompt part; its other PROMPT - PREFILL tokens go one forward each


@dataclass
class Exllamav3:
    config: Any
    model: Any
    cache: Any


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny(tmp_path_factory.mktemp("exl3_whole_model") / "ckpt", format="exl3", preset="exllamav3",
                     **LAYOUT)
    t = json.loads((path / "config.json").read_text())["text_config"]
    print(f"\ncheckpoint {path}: {LAYOUT}, hidden {t['hidden_size']}, KDA {t['linear_attn_config']['num_heads']} x "
          f"{t['linear_attn_config']['head_dim']}, MLA {t['num_attention_heads']} heads latent {t['kv_lora_rank']} "
          f"nope/v {t['qk_nope_head_dim']}/{t['v_head_dim']}, indexer {t['index_n_heads']} x {t['index_head_dim']} "
          f"top-{t['index_topk']} kpool {t['index_kpool']}, vocab {t['vocab_size']}")
    return path


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return prompt_ids()


@pytest.fixture(scope="module")
def reference(ckpt: Path, prompt: list[int]) -> torch.Tensor:
    """The truth: twinspark's CPU twin in fp32, every position's logits."""
    return prefill_logits(Glm5Model.load(ckpt, dtype=torch.float32, device="cpu", progress=False), prompt)


@pytest.fixture(scope="module")
def exl(ckpt: Path) -> Iterator[Exllamav3]:
    try:
        import exllamav3
        from exllamav3 import Cache, Config, Model
        from exllamav3.version import __version__
    except Exception as e:  # ImportError, or its CUDA extension failing to load / build
        pytest.skip(f"exllamav3 is not usable here: {type(e).__name__}: {e}")
    print(f"\nexllamav3 {__version__} from {Path(exllamav3.__file__).parent}")
    config = Config.from_directory(str(ckpt))
    print(f"  Config.from_directory: {type(config).__name__}, {config.num_hidden_layers} layers "
          f"{config.layer_types}, indexer {config.indexer_types}, vocab {config.vocab_size}")
    model = Model.from_config(config)
    # The cache before the load (the load allocates it): one page, one recurrent-state slot, fp32 recurrent state
    # (a single pass computes in fp32 either way; this keeps the decode test's carried state unrounded).
    cache = Cache(model, max_num_tokens=PAGE, max_batch_size=1, recurrent_dtype=torch.float)
    model.load(device=DEV)
    print(f"  Model.from_config + Cache({PAGE} tokens) + load({DEV}): {len(model.modules)} modules")
    yield Exllamav3(config, model, cache)
    model.unload()


def _logits(exl: Exllamav3, ids: list[int], params: dict) -> torch.Tensor:
    """exllamav3's logits of every row of `ids` -> [len(ids), vocab] fp32 on the CPU (its lm_head pads the vocabulary
    to 128 columns: cut back to the checkpoint's)."""
    out = exl.model.forward(torch.tensor([ids], dtype=torch.long), params)
    assert out.shape[:2] == (1, len(ids)), f"exllamav3 returned logits of shape {tuple(out.shape)}"
    return out[0, :, : exl.config.vocab_size].float().cpu()


def _release(exl: Exllamav3, params: dict) -> None:
    """Give the pass's recurrent-state slot back to the cache (it holds one), for the next test's pass."""
    for state in params.get("recurrent_states") or []:
        exl.cache.release_state(state)


def _cached(start: int, exl: Exllamav3, states: list | None = None) -> dict:
    """exllamav3's params for a pass over its paged cache from absolute position `start` (attn.py's
    "flash_attn" / batch_shape mode; recurrent_util.prepare_for_recurrence takes fresh states at start 0)."""
    params = {"attn_mode": "flash_attn", "cache": exl.cache, "batch_shape": (1, PAGE), "past_len": start}
    if states is not None:
        params["recurrent_states"] = states
    return params


def test_exllamav3_loads_every_exl3_linear_as_exl3(ckpt: Path, exl: Exllamav3) -> None:
    from exllamav3.modules import Linear
    stored = {k.removesuffix(".trellis") for k in read_tensors(ckpt) if k.endswith(".trellis")}
    mtp = f"model.language_model.layers.{LAYOUT['layers']}."  # the MTP block: exllamav3's "mtp" component
    stored = {k for k in stored if not k.startswith(mtp)}
    linears = [m for m in exl.model if isinstance(m, Linear)]
    loaded = {m.key: m.quant_type for m in linears}
    exl3 = {k for k, q in loaded.items() if q == "exl3"}
    print(f"\n{len(linears)} linears loaded: {len(exl3)} EXL3, "
          f"{sum(q == 'fp16' for q in loaded.values())} fp16; {len(stored)} EXL3 linears stored in the text model")
    assert exl3 == stored, f"EXL3 in the files but not loaded as EXL3: {sorted(stored - exl3)[:5]}; " \
                           f"loaded as EXL3 but not stored so: {sorted(exl3 - stored)[:5]}"
    assert set(loaded.values()) == {"exl3", "fp16"}, set(loaded.values())


def test_exllamav3_prefill_top1(exl: Exllamav3, prompt: list[int], reference: torch.Tensor) -> None:
    params = _cached(0, exl)
    try:
        got = _logits(exl, prompt, params)
    finally:
        _release(exl, params)
    assert compare_top1(f"exllamav3 prefill of {PROMPT} tokens (paged cache) vs twinspark fp32", got, reference) == 0


def test_exllamav3_cacheless_top1(exl: Exllamav3, prompt: list[int], reference: torch.Tensor) -> None:
    got = _logits(exl, prompt, {"attn_mode": "flash_attn_nc"})
    assert compare_top1(f"exllamav3 without a cache ({PROMPT} tokens) vs twinspark fp32", got, reference) == 0


def test_exllamav3_decode_top1(exl: Exllamav3, prompt: list[int], reference: torch.Tensor) -> None:
    params = _cached(0, exl)
    try:
        rows = [_logits(exl, prompt[:PREFILL], params)[-1:]]  # position PREFILL - 1: the last prompt row
        states = params["recurrent_states"]
        for t in range(PREFILL, PROMPT):
            step = _cached(t, exl, states)
            rows.append(_logits(exl, prompt[t : t + 1], step))
            states = step["recurrent_states"]
    finally:
        _release(exl, params)
    got = torch.cat(rows)
    name = f"exllamav3 {PREFILL}-token prefill + {PROMPT - PREFILL} decode steps vs twinspark fp32"
    assert compare_top1(name, got, reference[PREFILL - 1 :], first=PREFILL - 1) == 0


def test_twinspark_gpu_top1(ckpt: Path, prompt: list[int], reference: torch.Tensor) -> None:
    got = prefill_logits(Glm5Model.load(ckpt, dtype=torch.bfloat16, device="cuda", progress=False), prompt)
    assert compare_top1("twinspark fused (bf16, EXL3 experts packed) vs fp32", got, reference) == 0


def test_exllamav3_tokenizer_reads_the_checkpoint(ckpt: Path, exl: Exllamav3) -> None:
    from exllamav3 import Tokenizer
    from tokenizers import Tokenizer as Tokenizers
    text = exl.model.default_chat_prompt("Compare 4-bit trellis weights with <think>bf16</think>, twice.",
                                         system_prompt="You are terse.")
    theirs = Tokenizer.from_config(exl.config).encode(text, encode_special_tokens=True)[0].tolist()
    ours = Tokenizers.from_file(str(ckpt / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    print(f"\n{text!r}\n  exllamav3: {len(theirs)} tokens {theirs[:12]}...\n  twinspark: {len(ours)} tokens "
          f"{ours[:12]}...")
    assert theirs == ours
