"""An evaluation's result as JSON (every figure) and as a markdown table (what a person reads)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _num(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def markdown(result: dict[str, Any]) -> str:
    if result["kind"] == "ppl":
        head = f"Perplexity of `{result['model']}` ({result['url']})"
        rows = ["perplexity", "nll_per_token", "tokens", "scored_tokens_per_s"]
    else:
        head = (f"KL divergence of `{result['model']}` ({result['url']}) from `{result['ref_model']}` "
                f"({result['ref_url']})")
        rows = ["kl_mean", "kl_median", "kl_p90", "kl_p99", "kl_max", "top1_agreement", "positions", "perplexity",
                "ref_perplexity", "top_k"]
    source = (f"on `{result['file']}` (sha256 {result['sha256'][:12]}…, {result['text_tokens']} tokens), "
              f"{result['windows']} windows of {result['window']} tokens, stride {result['stride']}")
    lines = [f"### {head}", "", source, "", "| figure | value |", "|---|---:|"]
    lines += [f"| {r} | {_num(result[r])} |" for r in rows]
    if result["kind"] == "kl":
        lines += ["", f"KL in nats per position, over the top-{result['top_k']} buckets (docs/evaluation.md)."]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], prefix: Path) -> list[Path]:
    """PREFIX.json and PREFIX.md."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    out = [prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".md")]
    out[0].write_text(json.dumps(result, indent=2) + "\n")
    out[1].write_text(markdown(result))
    return out
