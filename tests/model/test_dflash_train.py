"""`twinspark train-drafter`'s pieces end to end on the tiny target: greedy traces with the drafter's target layers,
the block objective, a checkpoint in the published layout, and the drafter service's own method replaying serving's
rounds over the traces (bench/drafter_acceptance.py).

The drafter trains briefly on a few traces and is replayed on the same traces: what this checks is that the loop is
aligned (the labels the objective teaches are the tokens verification accepts, at the positions the service drafts
from, with the context rows it is sent), which a shifted label, row or position would break; whether the training
generalises to held-out prompts is the bench's question (minutes, not a test's seconds).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.drafter_acceptance import evaluate
from model.dflash import load_drafter
from model.dflash.train.traces import generate_traces, random_prompts, target_embed_head
from model.dflash.train.trainer import TrainSettings, train
from model.dflash.weights import save_checkpoint
from model.model import Glm5Model
from services.rank_worker.offline import GenerateRequest, generate_on_model


def test_trained_drafter_beats_untrained_and_copy(tiny_dflash: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    drafter = load_drafter(tiny_dflash / "dflash2")
    target = Glm5Model.load(tiny_dflash, progress=False)
    prompts = random_prompts(tiny_dflash, 8, 12, seed=0)
    traces = generate_traces(target, prompts, 24, list(drafter.config.target_layer_ids), progress=False)
    # The packed continuation is the offline generator's, token for token.
    assert traces.tokens[0, 12:].tolist() == generate_on_model(
        target, GenerateRequest(prompt_ids=tuple(prompts[0]), max_tokens=24, ignore_eos=True))
    embed, head = target_embed_head(tiny_dflash)
    # A step count, not a time budget, so the outcome does not depend on how busy the machine is.
    report = train(drafter, traces, embed, head, TrainSettings(max_steps=100, max_seconds=600, batch=8),
                   progress=False)
    assert report.steps == 100
    assert report.final_loss < report.first_loss / 4, report
    save_checkpoint(tmp_path / "trained", drafter.config, drafter.state_dict())
    results = evaluate(str(tiny_dflash), {"trained": str(tmp_path / "trained"),
                                          "untrained": str(tiny_dflash / "dflash2")}, traces, [4])
    trained, untrained, copy = (results[m][4].mean_accepted_length for m in ("trained", "untrained", "copy"))
    print(f"K 4: mean accepted length trained {trained:.2f}, untrained {untrained:.2f}, copy {copy:.2f}; "
          f"{time.monotonic() - t0:.1f} s in all")
    assert trained > max(untrained, copy) + 0.5


def test_train_drafter_cli_writes_a_loadable_drafter(tiny_dflash: Path, tmp_path: Path) -> None:
    """`twinspark train-drafter` end to end at toy sizes: the published layout, which the loader reads back with the
    trained weights, and training.json with what ran."""
    from services.cli import main

    out = tmp_path / "trained"
    assert main(["train-drafter", "--model", str(tiny_dflash), "--out", str(out), "--prompts", "4", "--held-out", "2",
                 "--prompt-tokens", "8", "--new-tokens", "6", "--steps", "5", "--batch", "4"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["training"]["steps"] == 5 and record["train_sequences"] == 4 and record["sequence_tokens"] == 14
    trained, untrained = load_drafter(out), load_drafter(tiny_dflash / "dflash2")
    assert trained.config == untrained.config
    assert not torch.equal(trained.fc.weight, untrained.fc.weight)
