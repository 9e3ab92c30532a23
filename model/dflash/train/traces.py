"""The target's own greedy continuations of a set of prompts, with the outputs of the drafter's target layers at
every position: what a DFlash2 drafter trains on and is evaluated against.

The prompts are decoded together in one packed batch per chunk of sequences (prefill, then one decode row per
sequence and step), through `Glm5Model.forward(layers=)` exactly as the ranks run it, so the rows are the ones a
served request's drafter would be sent (a prompt's with prefill arithmetic, a generated token's with decode
arithmetic). Greedy is argmax, the rule of the ranks' sampler at temperature 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from model.batch import Batch
from model.model import Glm5Model
from model.parallel import Sharding
from model.weights import TEXT_PREFIX, WeightReader

KV_BLOCK = 16


@dataclass
class Traces:
    """S sequences of one length N: the prompts (`prompt_len` tokens each) then the target's greedy continuation."""

    tokens: torch.Tensor  # [S, N] int64
    hidden: torch.Tensor  # [S, N - 1, L * D] fp32: the target layers' outputs at positions 0 .. N - 2
    prompt_len: int

    @property
    def num_seqs(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def subset(self, index: torch.Tensor | slice) -> "Traces":
        return Traces(self.tokens[index], self.hidden[index], self.prompt_len)


def random_prompts(model_dir: str | Path, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` ordinary token ids (below the tokenizer's first added token: no special tokens),
    uniform from a seeded generator. A random target reads no meaning into text, so any ids serve as well."""
    added = json.loads((Path(model_dir) / "tokenizer.json").read_text()).get("added_tokens", [])
    if not added:
        raise ValueError(f"{model_dir}/tokenizer.json lists no added tokens: no bound on the ordinary ids")
    ordinary = min(int(t["id"]) for t in added)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, ordinary, (n, length), generator=gen).tolist()


def target_embed_head(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and lm_head weights [V, D] in fp32: the drafter embeds and scores with them."""
    reader = WeightReader(model_dir, Sharding(), torch.float32, torch.device("cpu"), progress=False)
    try:
        return reader.full(TEXT_PREFIX + "embed_tokens.weight"), reader.full("lm_head.weight")
    finally:
        reader.close()


def generate_traces(model: Glm5Model, prompts: Sequence[Sequence[int]], new_tokens: int, layers: Sequence[int], *,
                    chunk: int = 64, progress: bool = True) -> Traces:
    """Greedy continuations of `new_tokens` tokens (end-of-sequence tokens ignored: the drafter learns what the
    target does after them too) of equal-length `prompts`, `chunk` sequences per packed batch."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1 or not prompts:
        raise ValueError(f"the prompts must be non-empty and of one length, got lengths {sorted(lengths)}")
    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2 (a draft needs a token after the anchor)")
    prompt_len = lengths.pop()
    parts = []
    bar = tqdm(total=len(prompts) * new_tokens, desc="target greedy continuations", unit="tok", disable=not progress)
    for first in range(0, len(prompts), chunk):
        parts.append(_continue(model, [list(p) for p in prompts[first : first + chunk]], new_tokens, layers, bar))
    bar.close()
    return Traces(torch.cat([t for t, _ in parts]), torch.cat([h for _, h in parts]), prompt_len)


def _continue(model: Glm5Model, prompts: list[list[int]], new_tokens: int, layers: Sequence[int],
              bar: tqdm) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed chunk of sequences: tokens [B, P + new] and layer rows [B, P + new - 1, L * D]."""
    b, p = len(prompts), len(prompts[0])
    total = p + new_tokens
    blocks = -(-total // KV_BLOCK)
    cache = model.new_cache(num_blocks=b * blocks, block_size=KV_BLOCK, num_slots=b)
    tables = torch.arange(b * blocks).view(b, blocks)
    tokens = torch.tensor(prompts, dtype=torch.long)
    rows: list[torch.Tensor] = []
    step = tokens  # the rows this forward computes: the whole prompts, then one new token per sequence
    for start in range(p, total):
        n = step.shape[1]
        batch = Batch(token_ids=step.reshape(-1), starts=[start - n] * b, lengths=[n] * b, block_tables=tables,
                      slots=list(range(b)), logit_rows=torch.arange(n - 1, b * n, n), prompt=[n > 1] * b)
        out = model.forward(batch, cache, layers=layers)
        rows.append(out.layers.view(b, n, -1).float())
        step = out.logits.argmax(dim=-1, keepdim=True).to(torch.long)
        tokens = torch.cat((tokens, step), dim=1)
        bar.update(b)
    # The last token's rows are never read: a drafter's context ends before its anchor.
    return tokens, torch.cat(rows, dim=1)[:, : total - 1]
