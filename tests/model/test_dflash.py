"""The DFlash2 drafter (model/dflash) against z-lab's reference implementation, and its checkpoint handling.

The reference is `DFlash2DraftModel` from the `dflash` package on PyPI (z-lab, MIT; installed with --no-deps
because its pins would replace our datasets / requests / tqdm; it needs only torch and transformers). It is a
transformers `Qwen3PreTrainedModel`; here it runs in fp32 on the same random weights, without a KV cache, over the
same context hidden states and block, and must give the same draft logits (within TOL) and the same draft tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from model.checkpoint.dflash_writer import random_tensors, tiny_dflash_config, write_tiny_dflash
from model.config import Dimensions
from model.dflash import (DFlashConfig, DFlashDrafter, DFlashWeightsError, check_shapes, expected_shapes,
                          load_drafter)
from model.dflash.layers import grouped_causal_conv

reference = pytest.importorskip("dflash.model", reason="the reference: pip install --no-deps dflash==0.1.0")

TOL = 1e-4
TINY_TARGET = {"text_config": {"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 1088}}


def _reference_names(name: str) -> str:
    """Our (= published) name -> the reference module's: it renames the bare codebooks on load (key_mapping)."""
    return f"{name}.weight" if name.endswith("_codebook") else name


def _reference_model(config: DFlashConfig, weights: dict[str, torch.Tensor]) -> nn.Module:
    from transformers import Qwen3Config

    model = reference.DFlash2DraftModel(Qwen3Config(**config.to_dict())).eval()
    model.load_state_dict({_reference_names(n): t for n, t in weights.items()}, strict=True)
    return model


def _inputs(config: DFlashConfig, *, batch: int = 2, context: int = 21, start: int = 40, seed: int = 1):
    """Context hidden states, a mask block after random anchors, positions, and target embedding / lm_head."""
    gen = torch.Generator().manual_seed(seed)
    h, v = config.hidden_size, config.vocab_size
    target_hidden = torch.randn(batch, context, len(config.target_layer_ids) * h, generator=gen)
    embed = torch.randn(v, h, generator=gen)
    head = torch.randn(v, h, generator=gen) / h ** 0.5
    anchors = torch.randint(0, v, (batch,), generator=gen)
    positions = torch.arange(start - context, start + config.block_size).expand(batch, -1)
    return target_hidden, anchors, positions, embed, head


def _tiny_config(top: dict | None = None, draft: dict | None = None) -> DFlashConfig:
    """The tiny drafter's config with `top` fields at the top level and `draft` fields in dflash_config changed."""
    base = tiny_dflash_config(TINY_TARGET, mask_token_id=3).to_dict()
    return DFlashConfig.from_dict({**base, **(top or {}), "dflash_config": {**base["dflash_config"], **(draft or {})}})


@pytest.mark.parametrize("top, draft", [({}, {}), ({"is_causal": False}, {}),
                                        ({}, {"final_logit_softcapping": None, "output_multiplier": 0.5})])
def test_parity_with_reference(top: dict, draft: dict) -> None:
    """Draft logits within TOL of the reference's and the same selected drafts; the context (21 rows) is longer
    than the window (8), so windowed and full layers see different keys. Variants: the reference's default
    (windowed layers causal), a config that makes every layer non-causal, and no soft-cap with a multiplier."""
    config = _tiny_config(top, draft)
    weights = random_tensors(config, seed=0)
    ours = DFlashDrafter(config).eval()
    ours.load_state_dict(weights, strict=True)
    ref = _reference_model(config, weights)
    target_hidden, anchors, positions, embed, head = _inputs(config)
    block = ours.mask_block(anchors)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    lm_head.weight.data = head
    with torch.no_grad():
        logits = ours(target_hidden, block, positions, embed, head)
        drafts = ours.propose(target_hidden, block, positions, embed, head)
        ref_hidden = ref(position_ids=positions, noise_embedding=F.embedding(block, embed),
                         target_hidden=target_hidden)[:, 1:]
        ref_logits = ref.compute_logits(ref_hidden, lm_head)
        ref_drafts, _, _ = ref.propose(ref_hidden, anchors, lm_head, 0.0)
    assert logits.shape == (2, config.block_size - 1, config.vocab_size)
    diff = (logits - ref_logits).abs().max().item()
    print(f"max |ours - reference| draft logit: {diff:.3g} (|logit| up to {ref_logits.abs().max().item():.3g})")
    assert diff < TOL
    assert torch.equal(drafts, ref_drafts)


def test_matches_reference_generation_loop() -> None:
    """The reference's own speculative loop (`dflash_generate`, greedy, with its draft KV cache cropped and extended
    round by round, windowed layers on sliding-window cache layers) drafts what our cache-free forward drafts from
    the whole context so far: every round's logits within TOL and the same drafts. The target is a tiny random
    transformers Qwen3; its drafts are rejected, so each round adds one context row and the loop runs many rounds,
    ending with blocks shorter than 16 as the token budget runs out."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = tiny_dflash_config(TINY_TARGET, mask_token_id=3)
    weights = random_tensors(config, seed=0)
    ref = _reference_model(config, weights)
    ours = DFlashDrafter(config).eval()
    ours.load_state_dict(weights, strict=True)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                          vocab_size=config.vocab_size)).eval()
    rounds: list[dict[str, torch.Tensor]] = []
    forward, propose = ref.forward, ref.propose

    def recording_forward(**kw: torch.Tensor) -> torch.Tensor:
        rounds.append({"context": kw["target_hidden"], "positions": kw["position_ids"],
                       "rows": torch.tensor(kw["noise_embedding"].shape[1])})
        return forward(**kw)

    def recording_propose(hidden: torch.Tensor, anchors: torch.Tensor, head: nn.Module,
                          temperature: float) -> tuple[torch.Tensor, ...]:
        drafts = propose(hidden, anchors, head, temperature)
        rounds[-1].update(anchors=anchors, drafts=drafts[0], logits=ref.compute_logits(hidden, head))
        return drafts

    ref.forward, ref.propose = recording_forward, recording_propose
    prompt = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(2))
    try:
        reference.dflash_generate(ref, target, prompt, max_new_tokens=26, stop_token_ids=None)
    except RuntimeError:
        # dflash 0.1.0 cannot convolve a block shorter than its kernel (the loop's last rounds); ours can.
        assert int(rounds[-1]["rows"]) < config.conv_kernel_size
        rounds.pop()
    assert len(rounds) > 20 and int(rounds[-1]["rows"]) < config.block_size
    embed, head = target.get_input_embeddings().weight, target.lm_head.weight
    contexts = []
    with torch.no_grad():
        for r in rounds:
            contexts.append(r["context"])  # the reference sends only the rows its cache lacks
            context = torch.cat(contexts, dim=1)
            rows = int(r["rows"])
            assert int(r["positions"][0, -rows]) == context.shape[1]  # the block starts right after the context
            block = torch.cat((r["anchors"][:, None], torch.full((1, rows - 1), config.mask_token_id)), dim=1)
            positions = torch.arange(context.shape[1] + rows)[None]
            hidden = ours.block_hidden(context, ours.embed(block, embed), positions)[:, 1:]
            logits = ours.logits(hidden, head)  # forward's and propose's steps, run once for both checks
            assert (logits - r["logits"]).abs().max().item() < TOL
            assert torch.equal(ours.candidate_selector(hidden, logits, block[:, 0]), r["drafts"])


def test_blocks_shorter_than_the_kernel() -> None:
    """The convolutions are causal along the block: on a block shorter than the kernel they give the first rows of
    the long block's result, and the drafter drafts from a two-row block (one draft)."""
    config = tiny_dflash_config(TINY_TARGET, mask_token_id=3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, config.hidden_size, generator=gen)
    dynamic = torch.randn(2, 16, config.conv_kernel_size, config.conv_groups, generator=gen)
    base = torch.randn(config.conv_kernel_size, config.hidden_size, generator=gen)
    whole = grouped_causal_conv(x, dynamic, base, config.conv_group_size)
    for rows in (1, 2, 3):
        short = grouped_causal_conv(x[:, :rows], dynamic[:, :rows], base, config.conv_group_size)
        torch.testing.assert_close(short, whole[:, :rows], rtol=0, atol=1e-6)
    drafter = DFlashDrafter(config).eval()
    drafter.load_state_dict(random_tensors(config, seed=0))
    target_hidden, anchors, _, embed, head = _inputs(config)
    block = drafter.mask_block(anchors)[:, :2]
    positions = torch.arange(target_hidden.shape[1] + 2).expand(2, -1)
    with torch.no_grad():
        assert drafter.propose(target_hidden, block, positions, embed, head).shape == (2, 1)


def test_tiny_writer_beside_tiny_target(tiny_default: Path, tmp_path: Path) -> None:
    """The tiny drafter written for the tiny target fits it (hidden, vocab, five of its layers, its [MASK] id), is
    byte-identical per seed, loads through our loader and through the reference's own `from_pretrained` (which
    reads the published names) to the same weights and the same logits."""
    files = write_tiny_dflash(tmp_path / "a", tiny_default, seed=7)
    again = write_tiny_dflash(tmp_path / "b", tiny_default, seed=7)
    assert [f.read_bytes() for f in files] == [f.read_bytes() for f in again]
    target = json.loads((tiny_default / "config.json").read_text())["text_config"]
    ours = load_drafter(tmp_path / "a")
    cfg = ours.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (
        target["hidden_size"], target["vocab_size"], target["num_hidden_layers"])
    assert len(cfg.target_layer_ids) == 5 and cfg.num_hidden_layers == 5
    tokens = json.loads((tiny_default / "tokenizer.json").read_text())["added_tokens"]
    assert cfg.mask_token_id == next(t["id"] for t in tokens if t["content"] == "[MASK]")

    ref = reference.DFlash2DraftModel.from_pretrained(str(tmp_path / "a"), dtype=torch.float32).eval()
    ref_state = ref.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, ref_state[_reference_names(name)]), name
    target_hidden, anchors, positions, embed, head = _inputs(cfg, batch=1)
    block = ours.mask_block(anchors)
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    lm_head.weight.data = head
    with torch.no_grad():
        ref_logits = ref.compute_logits(ref(position_ids=positions, noise_embedding=F.embedding(block, embed),
                                            target_hidden=target_hidden)[:, 1:], lm_head)
        assert (ours(target_hidden, block, positions, embed, head) - ref_logits).abs().max().item() < TOL


def test_published_names_and_shapes_match_reference() -> None:
    """At GLM-5.3-Flash's hidden size and vocabulary, the tensors our loader demands are exactly the reference
    module's parameters (bare codebook names, as its loader expects them in the checkpoint), shape for shape.
    The selector's rank 256 and top-k 16 are the published GLM drafter's; its other widths (heads, MLP, conv
    groups) are not in z-lab's repository, so these are Qwen3-like guesses."""
    from transformers import Qwen3Config

    dims = Dimensions()
    config = DFlashConfig.from_dict({
        **tiny_dflash_config(TINY_TARGET, mask_token_id=0).to_dict(),
        "hidden_size": dims.hidden_size, "vocab_size": dims.vocab_size, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "sliding_window": 2048,
        "num_target_layers": dims.num_hidden_layers,
        "dflash_config": {"target_layer_ids": [1, 11, 22, 32, 42], "mask_token_id": 154856, "block_size": 16,
                          "conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}})
    with torch.device("meta"):
        ref = reference.DFlash2DraftModel(Qwen3Config(**config.to_dict()))
    ref_shapes = {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    ours = {_reference_names(n): s for n, s in expected_shapes(config).items()}
    assert ours == ref_shapes
    check_shapes(expected_shapes(config), config, "published")  # accepted as is


def test_loader_names_bad_tensors(tmp_path: Path) -> None:
    """A wrong shape, a missing tensor and a stray tensor are each refused with the tensor named (and both shapes
    for a wrong one)."""
    config = tiny_dflash_config(TINY_TARGET, mask_token_id=3)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    weights = random_tensors(config, seed=0)
    name = "layers.2.attention_conv.kernel_projection.weight"
    save_file({**weights, name: torch.zeros(8, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashWeightsError, match=rf"tensor {name} has shape \[8, 64\], expected \[32, 64\]"):
        load_drafter(tmp_path)
    save_file({n: t for n, t in weights.items() if n != "fc.weight"} | {"model.fc.weight": weights["fc.weight"]},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashWeightsError, match=r"tensor fc.weight \(shape \[64, 320\]\) is missing.*"
                                                 r"tensor model.fc.weight \(shape \[64, 320\]\) is not a DFlash2"):
        load_drafter(tmp_path)
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = load_drafter(tmp_path)
    assert all(torch.equal(t, weights[n]) for n, t in loaded.state_dict().items())
    assert load_file(tmp_path / "model.safetensors").keys() == expected_shapes(config).keys()


def test_config_reads_published_spellings() -> None:
    """dflash_config wins over the top level (the reference's lookup order); Qwen3Config's defaults apply (no
    window without use_sliding_window, layer types from max_window_layers); missing drafter fields are named."""
    base = tiny_dflash_config(TINY_TARGET, mask_token_id=3).to_dict()
    assert DFlashConfig.from_dict(json.loads(json.dumps(base))) == DFlashConfig.from_dict(base)
    cfg = DFlashConfig.from_dict({**base, "selector_top_k": 99, "layer_types": None, "max_window_layers": 3})
    assert cfg.selector_top_k == base["dflash_config"]["selector_top_k"]
    assert cfg.layer_types == ("full_attention",) * 3 + ("sliding_attention",) * 2
    assert [cfg.causal(i) for i in range(5)] == [False, False, False, True, True]
    cfg = DFlashConfig.from_dict({**base, "use_sliding_window": False})
    assert cfg.window(0) is None and cfg.causal(0)  # the reference: a sliding-typed layer stays causal
    draft = {k: v for k, v in base["dflash_config"].items() if k not in ("selector_rank", "conv_group_size")}
    with pytest.raises(ValueError, match="lacks conv_group_size, selector_rank"):
        DFlashConfig.from_dict({**base, "dflash_config": draft})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        DFlashConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})


def test_make_tiny_writes_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`twinspark make-tiny --drafter dflash` writes the drafter into OUT/dflash2, loadable for that target."""
    from services.cli import main

    assert main(["make-tiny", "--out", str(tmp_path / "ckpt"), "--layers", "4", "--drafter", "dflash",
                 "--dtype", "float32"]) == 0
    assert "wrote tiny DFlash2 drafter" in capsys.readouterr().out
    drafter = load_drafter(tmp_path / "ckpt" / "dflash2")
    target = json.loads((tmp_path / "ckpt" / "config.json").read_text())["text_config"]
    assert drafter.config.num_target_layers == 4 and max(drafter.config.target_layer_ids) < 4
    assert drafter.config.vocab_size == target["vocab_size"]
    # The reference's default choice of target layers (1 .. L-3) leaves no valid layers in a 2-layer target.
    assert main(["make-tiny", "--out", str(tmp_path / "shallow"), "--layers", "2", "--drafter", "dflash"]) == 2
    assert "--drafter dflash: target_layer_ids [-1] outside the target's 2 layers" in capsys.readouterr().err
