"""`twinspark eval ppl` and `twinspark eval kl`: quality measured through a server's HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from services.evaluate.client import EvalError
from services.evaluate.report import markdown, write
from services.evaluate.runner import Settings, divergence, perplexity


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "eval", help="measure quality through the HTTP API: perplexity, KL divergence against another server",
        description="Score a text file through a served model's /v1/completions (echo, max_tokens 0 and vLLM's "
                    "prompt_logprobs: the prompt's logprobs, nothing generated), in windows of a chosen length. "
                    "Works against twinspark and any server with vLLM's prompt_logprobs.")
    sub = p.add_subparsers(dest="eval_command", metavar="KIND", required=True)
    ppl = sub.add_parser("ppl", help="perplexity of a text file", description="Perplexity of a text file: "
                         "exp(mean negative log-likelihood) of its tokens, each scored in its window.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(ppl)
    ppl.set_defaults(func=_run_ppl)
    kl = sub.add_parser("kl", help="KL divergence and top-1 agreement of one server against another",
                        description="KL(reference || model) per scored position, from each server's top-k prompt "
                        "logprobs over the same windows (the ids in both top-k lists and one bucket for the rest: "
                        "never above the full-vocabulary KL; docs/evaluation.md), top-1 agreement, and both "
                        "perplexities. Both servers must use the same tokenizer.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _common(kl)
    kl.add_argument("--ref-url", required=True, help="the reference server (e.g. the bf16 model)")
    kl.add_argument("--top-k", type=int, default=20, help="top logprobs per position from each server (1..20)")
    kl.set_defaults(func=_run_kl)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the server (http://HOST:PORT or http://HOST:PORT/v1)")
    p.add_argument("--file", required=True, type=Path, help="a UTF-8 text file")
    p.add_argument("--window", type=int, default=512, help="tokens per window (<= the server's window)")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: --window, "
                   "non-overlapping; less: each window counts only its last STRIDE tokens, the rest is context)")
    p.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    p.add_argument("--concurrency", type=int, default=4, help="windows in flight at once")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    p.add_argument("--out", type=Path, default=None, metavar="PREFIX", help="write PREFIX.json and PREFIX.md")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _settings(args: argparse.Namespace) -> Settings:
    return Settings(file=args.file, window=args.window, stride=args.stride, max_windows=args.max_windows,
                    top_k=getattr(args, "top_k", 20), concurrency=args.concurrency, progress=not args.no_progress,
                    api_key=args.api_key)


def _finish(result: dict[str, Any], args: argparse.Namespace) -> int:
    print(markdown(result))
    if args.out is not None:
        for path in write(result, args.out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace, job: Any) -> int:
    try:
        result = asyncio.run(job)
    except (EvalError, ValueError, OSError) as exc:
        print(f"twinspark eval {args.eval_command}: {exc}", file=sys.stderr)
        return 1
    return _finish(result, args)


def _run_ppl(args: argparse.Namespace) -> int:
    return _run(args, perplexity(args.url, _settings(args)))


def _run_kl(args: argparse.Namespace) -> int:
    return _run(args, divergence(args.url, args.ref_url, _settings(args)))
