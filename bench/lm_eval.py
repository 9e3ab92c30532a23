"""lm-evaluation-harness 0.4 against a twinspark stack: its `local-completions` model on a log-likelihood task (every
choice scored with echo + logprobs, max_tokens 1) and its `local-chat-completions` model on a generation task, both
with data shipped in bench/lm_eval_tasks (60 items; no hub access: HF_DATASETS_OFFLINE, the `json` builder).

    pip install "lm-eval==0.4.13"
    python -m bench.lm_eval --out bench/results            # starts a TP 2 stack of the tiny model, runs, stops it
    python -m bench.lm_eval --state-dir DIR --limit 20      # against a running `twinspark up`

lm-eval is not a dependency of the project (its own dependencies — datasets, pandas, pyarrow, scipy, scikit-learn,
nltk — would weigh on every CI install); the API behaviour it relies on is pinned in the suite by
tests/e2e/test_lm_eval_api.py. A run counts as passed when every request of both tasks was answered (lm-eval raises
on a failed request after its retries) and the gateway logged no failed request (its /metrics).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import flags
from bench.output import args_record, write_results
from bench.stack import add_stack_args, attach_or_start, machine_load

TASKS = Path(__file__).parent / "lm_eval_tasks"
MC, GEN = "twinspark_arith_mc", "twinspark_arith_gen"


def _task_dir() -> Path:
    """The task yamls with their data file's absolute path (lm-eval reads `data_files` relative to the cwd)."""
    out = Path(tempfile.mkdtemp(prefix="twinspark-lm-eval-"))
    data = (TASKS / "arithmetic.jsonl").resolve()
    for name in (MC, GEN):
        (out / f"{name}.yaml").write_text((TASKS / f"{name}.yaml").read_text().replace("DATA_FILE", str(data)))
    return out


def _outcomes(url: str) -> dict[str, float]:
    """Requests the gateway has finished, by outcome (`twinspark:request_success_total{finished_reason}`)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("twinspark:request_success_total{"):
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _run(model: str, model_args: dict[str, Any], task: str, limit: int | None, chat: bool) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    t0 = time.monotonic()
    res = simple_evaluate(model=model, model_args=model_args, tasks=[task], limit=limit, log_samples=True,
                          apply_chat_template=chat, task_manager=TaskManager(include_path=str(_task_dir())),
                          random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    samples = res["samples"][task]
    return {"model": model, "task": task, "metrics": {k: v for k, v in res["results"][task].items() if k != "alias"},
            "samples": len(samples), "requests": sum(len(s["resps"]) for s in samples),
            "seconds": round(time.monotonic() - t0, 1),
            "first_samples": [{"doc": s["doc"]["question"], "target": s["target"], "resps": s["resps"][:4]}
                              for s in samples[:3]]}


def main(argv: list[str] | None = None) -> int:
    ap = flags.parser("bench.lm_eval", __doc__)
    add_stack_args(ap)
    flags.add(ap, flags.OUT, "folder for lm_eval-<time>.json/.md (default: print only)")
    ap.add_argument("--limit", type=int, default=None, help="items per task (default: all 60)")
    args = ap.parse_args(argv)
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import lm_eval

    stack = attach_or_start(args.state_dir, tp=int(args.tp), model=args.model)
    try:
        url, info = stack.url, stack.up_json()
        name = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        before, load = _outcomes(url), machine_load()
        common = {"model": name, "num_concurrent": 1, "max_retries": 1, "timeout": 600}
        mc = _run("local-completions", {**common, "base_url": url + "/v1/completions", "tokenizer": info["model"],
                                        "tokenizer_backend": "huggingface", "max_length": 2048},
                  MC, args.limit, chat=False)
        gen = _run("local-chat-completions", {**common, "base_url": url + "/v1/chat/completions",
                                              "eos_string": "<|endoftext|>"}, GEN, args.limit,
                   chat=True)
        after = _outcomes(url)
    finally:
        stack.down()
    done = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    errors = done.get("error", 0.0) + done.get("abort", 0.0)
    data = {"lm_eval": lm_eval.__version__, "stack": {"tp": info["tp"], "device": info["device"],
                                                      "model": info["model"]},
            "runs": [mc, gen], "gateway_outcomes": done, "errors": errors, "load": load, "args": args_record(args)}
    md = (f"# lm-evaluation-harness {lm_eval.__version__} against twinspark\n\n"
          f"Stack: TP {info['tp']}, {info['device']}, `{Path(info['model']).name}`. Gateway outcomes during the "
          f"runs: {json.dumps(done)}; errors: {errors:g}.\n\n| model | task | items | requests | metrics | s |\n"
          "|---|---|---:|---:|---|---:|\n" +
          "".join(f"| `{r['model']}` | `{r['task']}` | {r['samples']} | {r['requests']} | "
                  f"{', '.join(f'{k} {v:.3f}' for k, v in r['metrics'].items() if isinstance(v, float))} | "
                  f"{r['seconds']} |\n" for r in (mc, gen)))
    print(md)
    write_results(args.out, "lm_eval", data, md)
    return 0 if errors == 0 and mc["samples"] and gen["samples"] else 1


if __name__ == "__main__":
    sys.exit(main())
