"""`twinspark eval` against real stacks (the session's TP 2 and TP 1 stacks of the tiny model): the perplexity of a
text equals the offline runtime's over the same windows, and the KL divergence of the TP 1 server from the TP 2 one
is 0 with full top-1 agreement (the same bits); each writes its JSON and markdown report."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from services.evaluate.windows import cut
from services.gateway.tokenizer import TextTokenizer
from services.rank_worker.offline import prompt_log_softmax
from tests.e2e.stack import TWINSPARK
from tests.model.reference import our_model

TEXT = Path(__file__).parents[2] / "bench" / "data" / "eval_text.txt"
WINDOW, STRIDE, WINDOWS = 128, 96, 4


def _eval(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([TWINSPARK, "eval", *args, "--file", str(TEXT), "--window", str(WINDOW), "--stride",
                           str(STRIDE), "--max-windows", str(WINDOWS)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_ppl_equals_the_offline_runtime(stack_tp2, tiny_default, tmp_path):
    proc = _eval("ppl", "--url", stack_tp2.v1, "--out", str(tmp_path / "ppl"))
    result = json.loads((tmp_path / "ppl.json").read_text())
    assert "| perplexity |" in proc.stdout and (tmp_path / "ppl.md").read_text() in proc.stdout + "\n"
    assert "scoring" in proc.stderr  # the progress bar
    ids = TextTokenizer(tiny_default).encode(TEXT.read_text(), add_special_tokens=False)
    model = our_model(tiny_default)
    nll = tokens = 0
    for w in cut(ids, WINDOW, STRIDE, WINDOWS):
        ref = prompt_log_softmax(model, w.ids)
        lp = ref.gather(1, torch.tensor(w.ids[1:])[:, None]).squeeze(1).tolist()[w.counted_from - 1 :]
        nll -= sum(lp)
        tokens += len(lp)
    assert result["tokens"] == tokens == WINDOW - 1 + (WINDOWS - 1) * STRIDE and result["windows"] == WINDOWS
    assert result["perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-12)


def test_kl_of_the_same_model_at_another_tp_is_zero(stack_tp1, stack_tp2, tmp_path):
    _eval("kl", "--url", stack_tp1.url, "--ref-url", stack_tp2.v1, "--top-k", "5", "--no-progress",
          "--out", str(tmp_path / "kl"))
    result = json.loads((tmp_path / "kl.json").read_text())
    assert result["kl_mean"] == 0.0 and result["kl_max"] == 0.0 and result["top1_agreement"] == 1.0
    assert result["perplexity"] == result["ref_perplexity"] and result["top_k"] == 5
