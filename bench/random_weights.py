"""The benchmark model: random weights at the real GLM-5.3-Flash layer dimensions, made directly on the device (no
download, no disk), dense or quantized (a quantize `Recipe`).

The reader itself (`RandomWeightReader`, also behind `serve-rank --random-weights`) lives with the model in
model/random_weights.py; this file fills a `TinySpec` with the release's dimensions.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

from model.config import ModelConfig
from model.model import Glm5Model
from model.parallel import Collective, Sharding
from model.quantize.select import Recipe
from model.random_weights import RandomWeightReader, keeps_fp32, text_tensors
from model.checkpoint.config_builder import text_config
from model.checkpoint.spec import TinySpec, default_layer_pattern

__all__ = ["RandomWeightReader", "bench_config", "bench_spec", "build_model", "keeps_fp32",
           "spec_dims", "text_tensors"]

REAL_PAD_TOKEN_ID = 154820
TINY_VOCAB = 1088  # make-tiny's vocabulary size (1026 tokens rounded up to 64); the benchmark needs no tokenizer


def bench_spec(*, layers: int = 4, layer_pattern: str | None = None, tiny: bool = False) -> TinySpec:
    """Real dimensions (or make-tiny's defaults with `tiny`), `layers` layers, no MTP block.

    Layer pattern: the release's 3:1 layout by default ("KKKM" for 4 layers). FFNs: the first layer dense, the
    rest MoE (TinySpec's rule), so 4 layers = 3 KDA + 1 MLA/DSA, 1 dense + 3 MoE.
    """
    shape = dict(num_hidden_layers=layers, layer_pattern=layer_pattern or default_layer_pattern(layers),
                 num_nextn_predict_layers=0)
    return TinySpec.tiny(vocab_size=TINY_VOCAB, **shape) if tiny else TinySpec(**shape)  # or the release's dims


def bench_config(spec: TinySpec) -> ModelConfig:
    pad = REAL_PAD_TOKEN_ID if REAL_PAD_TOKEN_ID < spec.vocab_size else 0
    return ModelConfig.from_hf_dict(text_config(spec, pad_token_id=pad, eos_token_ids=[pad]))


def spec_dims(spec: TinySpec) -> dict[str, object]:
    """The spec as plain JSON-able values (for the results file)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(spec).items()
            if not k.startswith("vision_")}


def build_model(spec: TinySpec, *, device: torch.device | str, dtype: torch.dtype, seed: int = 0, virtual: int = 1,
                recipe: Recipe | None = None, log: Callable[[str], None] | None = None
                ) -> tuple[Glm5Model, RandomWeightReader]:
    """A one-rank `Glm5Model` over random weights (no MTP). `virtual=1`: one product per weight, for speed.
    recipe: the linears drawn quantized (None: all dense)."""
    sharding = Sharding(virtual=virtual)
    reader = RandomWeightReader(spec, sharding, dtype, device, seed=seed, recipe=recipe, log=log)
    quiet = {"progress": False} if "progress" in inspect.signature(Glm5Model.__init__).parameters else {}
    model = Glm5Model(bench_config(spec), reader, Collective(sharding), load_mtp=False, **quiet)
    reader.close()
    return model, reader
