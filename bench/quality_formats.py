"""What each weight format costs in quality, and what it gives in speed: a dense checkpoint quantized with
`twinspark quantize` to every format, each served with `twinspark up`, its KL divergence from the dense model and
top-1 agreement (`twinspark eval kl`'s arithmetic: top-k prompt logprobs through the HTTP API), its perplexity, and
its batch-1 decode rate through the same stack.

    python -m bench.quality_formats --out bench/results                     # CPU: the tiny model (exl3 preset)
    bash bench/gpu_check.sh quality                                          # H200: 4 layers at the release's dims
    python -m bench.quality_formats --device cuda --dims release --experts 16 --out $OUT   # what that runs

The dense base is written here (make-tiny's tensors, seed 0) with make-tiny's calm initialisation (embeddings of
std 16, model/checkpoint/presets.py: every block's update small beside the residual, as in trained models; at the
default std 1 a random model is chaotic and amplifies any rounding: fp8 agreed with fp32 on 62% of top-1 tokens).
On the CPU: the tiny model at make-tiny's `exllamav3` preset (hidden 128, 512-wide MLPs, whole 128 x 128 EXL3 tiles
on 4 virtual shards; the default tiny model has no linear EXL3 can hold) in float32. With `--dims release`: the
release's dimensions (hidden 4096, vocabulary 154,880, 3:1 KDA / MLA, KKKM with one dense FFN layer) in bfloat16,
with `--experts` routed experts per MoE layer instead of 288, so the dense base and its quantized copies fit a
lent machine's disk and the EXL3 encoder finishes in one call (the per-expert arithmetic, the one that matters for
a format's error, is the release's). The reference is the dense base served the same way; the same windows of
bench/data/eval_text.txt are scored on each stack. On the CPU, `--exact` also computes the full-vocabulary KL
offline (both models loaded here, `offline.prompt_log_softmax`), next to the API's top-k estimate.

--formats takes `twinspark quantize` recipes too, written in one quantize run each: `--formats int3+fp8,int3+fp8+fp8`
measures lm_head in fp8 (the recipe's third term) beside int3+fp8. At the release's vocabulary (154,880 rows) an fp8
lm_head in 128 x 128 blocks divides into 1 or 2 virtual shards, not the default 4: give `--virtual-shards 2`, which
plans every checkpoint and serves every stack (the dense reference's too) at that count.

Writes quality_formats-<time>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import flags
from bench.output import args_record, stamp, write_results
from bench.served_load import level, summarize, warm_up
from bench.stack import attach_or_start, machine_load, twinspark_command
from model.quantize.select import VIRTUAL_SHARDS
from services.common import shared_flags as shared
from services.evaluate.client import ModelClient
from services.evaluate.runner import Settings, compare, score_windows, text_windows

FORMATS = "fp8,w4a16,int4,int3,int2,exl3:2.5,exl3:3.0,exl3:4.0"
TEXT = Path(__file__).parent / "data" / "eval_text.txt"


CALM_EMBED_STD = 16.0  # make-tiny's exllamav3 preset (model/checkpoint/presets.py)


def write_base(out: Path, *, dims: str, layers: int, experts: int) -> Path:
    """The dense base checkpoint (see the module note)."""
    if dims == "tiny":
        from model.checkpoint import make_tiny

        return make_tiny(out, layers=layers, preset="exllamav3", dtype="float32")
    import torch

    from model.checkpoint import write_model_files
    from model.checkpoint.quantized import materialize
    from model.checkpoint.shards import plan_shards, write_shards
    from model.checkpoint.spec import TinySpec
    from model.checkpoint.tokenizer_builder import build_tokenizer
    from model.checkpoint.weights import all_tensors

    spec = TinySpec(num_hidden_layers=layers, dense_layers=1, n_routed_experts=experts, num_nextn_predict_layers=1,
                    embed_std=CALM_EMBED_STD)
    tok = build_tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    write_model_files(out, spec, tok, dtype="bfloat16")
    specs = all_tensors(spec)
    write_shards(out, plan_shards(specs, torch.bfloat16, 4 << 30), torch.bfloat16,
                 lambda s: {s.key: materialize(s, 0, torch.bfloat16)}, progress=True)
    return out


def quantize(base: Path, out: Path, fmt: str, device: str, virtual: int) -> dict[str, Any]:
    t0 = time.monotonic()
    proc = subprocess.run([twinspark_command(), "quantize", "--model", str(base), "--out", str(out), "--format", fmt,
                           "--device", device, "--virtual-shards", str(virtual)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"quantize {fmt} failed:\n{proc.stderr[-2000:]}")
    return {"quantize_s": round(time.monotonic() - t0, 1), "bytes": _weight_bytes(out)}


def _weight_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


def decode_rate(url: str, output_len: int) -> float:
    """Batch-1 decode tok/s of a streamed greedy request (median inter-token latency), after one untimed pass."""
    bodies = [{"prompt": list(range(5, 69)), "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
               "stream": True, "draft": False}] * 2
    warm_up(url, bodies[:1], 1)
    samples, wall = asyncio.run(level(url, bodies, 1))
    itl = summarize(samples, wall, 64)["itl"]
    return 1e3 / itl["median_ms"] if itl else float("nan")


def serve_and_score(ckpt: Path, args: argparse.Namespace, windows: list | None) -> tuple[Any, list, float]:
    """Start a stack of `ckpt`, score the text's windows with top-k, time its decode, stop it."""
    env = {"TWINSPARK_DEVICE": args.device, "TWINSPARK_DRAFTER": "none",
           "TWINSPARK_VIRTUAL_SHARDS": str(args.virtual_shards)}
    stack = attach_or_start(None, tp=args.tp, model=str(ckpt), env=env)
    try:
        s = Settings(file=args.file, window=args.window, max_windows=args.max_windows, top_k=args.top_k,
                     concurrency=args.concurrency, progress=False)

        async def run() -> tuple[Any, list]:
            async with ModelClient(stack.url) as client:
                ws = windows if windows is not None else (await text_windows(client, s))[0]
                return ws, await score_windows(client, ws, s, s.top_k, f"scoring {ckpt.name}")

        ws, scored = asyncio.run(run())
        rate = decode_rate(stack.url + "/v1", args.output_len)
    finally:
        stack.down()
    return ws, scored, rate


def exact_kl(base: Path, ckpt: Path, windows: list) -> dict[str, float]:
    """Full-vocabulary KL(base || ckpt) and top-1 agreement over the counted positions, offline on the CPU."""
    import torch

    from model.model import Glm5Model
    from services.rank_worker.offline import prompt_log_softmax

    p_model = Glm5Model.load(base, dtype=torch.float32, progress=False)
    q_model = Glm5Model.load(ckpt, dtype=torch.float32, progress=False)
    kl, same, n = 0.0, 0, 0
    for w in windows:
        p = prompt_log_softmax(p_model, w.ids)[w.counted_from - 1 :].double()
        q = prompt_log_softmax(q_model, w.ids)[w.counted_from - 1 :].double()
        kl += float((p.exp() * (p - q)).sum())
        same += int((p.argmax(-1) == q.argmax(-1)).sum())
        n += p.shape[0]
    return {"kl_exact_mean": kl / n, "top1_exact": same / n}


def markdown(data: dict[str, Any]) -> str:
    a = data["args"]
    lines = [f"# Quality per weight format — {data['date']}", "",
             f"Base: {data['base']} ({data['base_bytes'] / 2**20:.1f} MiB of weights), served with `twinspark up "
             f"--device {a['device']} --tp {a['tp']}` (drafter off, {a['virtual_shards']} virtual shards) per "
             f"format. Text: `{Path(a['file']).name}`, {data['windows']} windows of {a['window']} tokens, "
             f"{data['positions']} scored positions. KL(base ‖ format) in nats per position over the "
             f"top-{a['top_k']} buckets (docs/evaluation.md: never above the full KL)"
             f"{'; exact: full vocabulary, offline' if a['exact'] else ''}. Decode: batch-1 streamed greedy, "
             f"median inter-token latency, {a['output_len']} tokens after a 64-token prompt.", "",
             "| format | weight MiB | × base | KL mean | KL p99 | KL exact | top-1 agreement | perplexity "
             "| decode tok/s | quantize s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["rows"]:
        if "error" in r:
            lines.append(f"| {r['format']} | failed: {r['error'][:120]} | | | | | | | | |")
            continue
        exact = f"{r['kl_exact_mean']:.4g}" if "kl_exact_mean" in r else "—"
        lines.append(f"| {r['format']} | {r['bytes'] / 2**20:.1f} | {r['bytes'] / data['base_bytes']:.3f} | "
                     f"{r.get('kl_mean', 0):.4g} | {r.get('kl_p99', 0):.4g} | {exact} | "
                     f"{r.get('top1_agreement', 1):.4f} | {r['perplexity']:.4g} | {r['decode_tok_s']:.1f} | "
                     f"{r.get('quantize_s', '—')} |")
    lines += ["", data["load_line"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.quality_formats", __doc__)
    ap.add_argument("--base", type=Path, help="a dense checkpoint (default: write one, see --dims)")
    ap.add_argument("--dims", choices=("tiny", "release"), default="tiny")
    flags.add(ap, flags.LAYERS, "text layers of the base (default 4)")
    ap.add_argument("--experts", type=int, default=16, help="--dims release: routed experts per MoE layer")
    ap.add_argument("--formats", default=FORMATS, help="comma-separated `twinspark quantize --format` values (formats "
                    "or recipes, e.g. int3+fp8,int3+fp8+fp8)")
    ap.add_argument("--virtual-shards", type=int, default=VIRTUAL_SHARDS, help="the virtual shards every checkpoint is "
                    "planned for and every stack served at (2 for an fp8 lm_head at the release's vocabulary)")
    flags.add(ap, flags.RANKS_DEVICE, "where the formats are quantized and served (default cpu)", default="cpu")
    flags.add(ap, shared.TP)
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoints go (default: a temporary dir)")
    ap.add_argument("--file", type=Path, default=TEXT)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=4)
    flags.add(ap, flags.OUTPUT_LEN, "tokens of the timed decode (default 64)", default="64")
    ap.add_argument("--exact", action="store_true", help="also the full-vocabulary KL, offline on the CPU")
    flags.add(ap, flags.OUT)
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="twinspark-quality-"))
    load = machine_load()
    t0 = time.monotonic()
    base = args.base or write_base(work / "base", dims=args.dims, layers=args.layers, experts=args.experts)
    print(f"base {base} written in {time.monotonic() - t0:.0f} s", flush=True)
    windows, ref, ref_rate = serve_and_score(base, args, None)
    positions = sum(w.counted for w in windows)
    rows: list[dict[str, Any]] = [{"format": "dense (reference)", "bytes": _weight_bytes(base), "top1_agreement": 1.0,
                                   "kl_mean": 0.0, "kl_p99": 0.0, "decode_tok_s": ref_rate,
                                   **{"perplexity": compare(windows, ref, ref)["perplexity"]}}]
    print(f"reference: ppl {rows[0]['perplexity']:.4g}, decode {ref_rate:.1f} tok/s", flush=True)
    data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "base": f"{args.dims} dims, "
            f"{args.layers} layers" + (f", {args.experts} experts" if args.dims == "release" else ""),
            "base_bytes": _weight_bytes(base), "windows": len(windows), "positions": positions, "rows": rows,
            "args": args_record(args),
            "load_line": f"Machine load before: {load['loadavg_1_5_15']} ({load['cpus']} CPUs)."}
    # Saved after every format under one stamp: a run cut short (a lent machine's time limit) keeps what it measured.
    at = stamp()
    write_results(args.out, "quality_formats", data, markdown(data), at=at)
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        row: dict[str, Any] = {"format": fmt}
        try:
            ckpt = work / fmt.replace(":", "_")
            row.update(quantize(base, ckpt, fmt, args.device, args.virtual_shards))
            _, scored, row["decode_tok_s"] = serve_and_score(ckpt, args, windows)
            row.update(compare(windows, ref, scored))
            if args.exact:
                row.update(exact_kl(base, ckpt, windows))
            print(f"{fmt}: KL {row['kl_mean']:.4g}, top-1 {row['top1_agreement']:.4f}, ppl {row['perplexity']:.4g}, "
                  f"decode {row['decode_tok_s']:.1f} tok/s", flush=True)
        except Exception as exc:  # a failed format is recorded and the next one still runs
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{fmt}: {row['error']}", flush=True)
        rows.append(row)
        write_results(args.out, "quality_formats", data, markdown(data), at=at)
    print(markdown(data))
    return 0 if all("error" not in r for r in rows) and not any(math.isnan(r.get("decode_tok_s", 0)) for r in rows) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
