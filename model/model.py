"""GLM-5.3-Flash text model on one rank: load this rank's shard, run packed varlen forwards over paged caches.

Entry points:
- `Glm5Model.load(model_dir, ...)`
- `model.forward(batch, cache)`      target model: logits for `batch.logit_rows`, final hidden for every row (and,
                                     with `layers`, those layers' outputs for every row: what DFlash drafts read)
- `model.forward_mtp(batch, cache)`  MTP block: draft logits for `batch.logit_rows`
- `model.commit_verify(batch, cache, accepted)`  after sampling a batch with verify windows: keep each window's KDA
  state of its last accepted row (`accept_drafts` computes `accepted` from the window's tokens and samples)
- `model.new_cache(...)`             the physical caches sized for this rank
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import ops
from model import projection
from model.batch import Batch
from model.cache import PagedCache
from model.config import ModelConfig
from model.decoder_layer import DecoderLayer
from model.forward import Forward, Selections
from model.mtp import MtpBlock
from model.parallel import Collective, Sharding
from model.projection import COLUMNS
from model.vision import VisionConfig, VisionTower
from model.weights import TEXT_PREFIX, WeightReader


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab] fp32, full vocabulary on every rank
    hidden: torch.Tensor  # [T, D] final normed hidden state of every packed row
    layers: torch.Tensor | None = None  # [T, L * D] the outputs of the asked layers (mean of the mHC streams)


class Glm5Model:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, coll: Collective, *, load_mtp: bool = True,
                 load_target: bool = True, vision: VisionConfig | None = None) -> None:
        self.cfg = cfg
        self.coll = coll
        self.dtype = reader.dtype
        self.device = reader.device
        self.embed = reader.full(TEXT_PREFIX + "embed_tokens.weight")
        # Which ops run (the fused kernels or the torch reference) is decided once, by where the weights live.
        self.fused = ops.uses_fused(self.embed)
        # load_target=False: embeddings, lm_head and the MTP block only (the MTP drafter's model; no `forward`).
        self.layers = [DecoderLayer(cfg, reader, f"{TEXT_PREFIX}layers.{i}.", i)
                       for i in range(cfg.num_hidden_layers)] if load_target else []
        self.norm = reader.full(TEXT_PREFIX + "norm.weight")
        self.lm_head = projection.load(reader, ["lm_head.weight"], COLUMNS)  # [S, vocab / virtual shards, D]
        mtp_prefix = f"{TEXT_PREFIX}layers.{cfg.mtp_layer_index}."
        self.mtp = (MtpBlock(cfg, reader, mtp_prefix)
                    if load_mtp and cfg.num_nextn_predict_layers and reader.has(mtp_prefix + "eh_proj.weight") else None)
        # The vision tower, where this rank runs it (rank 0; the executor broadcasts its embeddings).
        self.vision = VisionTower(vision, reader) if vision is not None else None

    @classmethod
    def load(cls, model_dir: str | Path, *, sharding: Sharding | None = None, group=None, exchange=None,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", load_mtp: bool = True,
             progress: bool = True, load_target: bool = True, load_vision: bool = False) -> "Glm5Model":
        sharding = sharding or Sharding()
        cfg = ModelConfig.from_pretrained(model_dir)
        vision = VisionConfig.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text())) \
            if load_vision else None
        reader = WeightReader(model_dir, sharding, dtype, torch.device(device), progress=progress)
        try:
            return cls(cfg, reader, Collective(sharding, group, exchange), load_mtp=load_mtp, load_target=load_target,
                       vision=vision)
        finally:
            reader.close()

    def new_cache(self, *, num_blocks: int, block_size: int = 16, num_slots: int = 8,
                  kv_dtype: torch.dtype | None = None) -> PagedCache:
        """kv_dtype: storage of the latent / indexer rows (None = the compute dtype; see row_store.KV_CACHE_DTYPES)."""
        return PagedCache(self.cfg, self.coll.sharding, num_blocks=num_blocks, block_size=block_size,
                          num_slots=num_slots, dtype=self.dtype, device=self.device, with_mtp=self.mtp is not None,
                          kv_dtype=kv_dtype)

    def _inputs(self, fwd: Forward) -> torch.Tensor:
        """The first layer's input rows: token embeddings, with image placeholder rows taking their image's
        embeddings (`Batch.embeds`, on this device already). Both paths merge here, so an image row gets the same
        bits on either; on the fused path it is a device copy per image run (no host sync)."""
        x = self.embed[fwd.token_ids]  # a gathered copy: the rows may be overwritten
        for row, e in fwd.batch.embeds or []:
            x[row : row + e.shape[0]] = e.to(x.dtype)
        return x

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: PagedCache, *, fused: bool | None = None,
                layers: Sequence[int] = ()) -> ForwardOutput:
        """Logits of batch.logit_rows and the final hidden state of every row. fused: run the fused kernels (the
        default where the weights are on CUDA; they need the decode-class sequences first, see Batch.permuted) or
        the torch reference; the tests also run the fused ones in Triton's CPU interpreter. layers: also return
        these layers' outputs (ForwardOutput.layers)."""
        return self.run(ops.begin(batch, cache, fused=self.fused if fused is None else fused), layers)

    @torch.inference_mode()
    def run(self, fwd: Forward, layers: Sequence[int] = ()) -> ForwardOutput:
        """The target model over one forward's ops (a CUDA graph captures this with a static fused forward).

        A layer's output, for `layers`, is the plain mean of its mHC streams: the collapse the final norm reads,
        and the single hidden state per position a drafter trained on the collapsed model (DFlash2) conditions on."""
        streams = self._inputs(fwd).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        selections: Selections = {}
        outputs: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            streams = layer.forward(streams, fwd, selections, self.coll)
            if i in layers:
                outputs[i] = streams[: fwd.n_rows].mean(dim=1)
        hidden = fwd.hc_final(streams, self.norm, self.cfg.rms_norm_eps)
        picked = torch.cat([outputs[i] for i in layers], dim=-1) if layers else None
        return ForwardOutput(fwd.logits(hidden, self.lm_head, self.coll), hidden[: fwd.n_rows], picked)

    @torch.inference_mode()
    def commit_verify(self, batch: Batch, cache: PagedCache, accepted: dict[int, int]) -> None:
        """accepted: verify sequence index -> drafts accepted. Must follow every forward with verify windows: each
        window's slot keeps the KDA state of its last accepted row (row 0 is the last committed token, so accepting
        a drafts keeps row a)."""
        pending = next(iter(cache.pending.values()), None)  # every KDA layer of one forward has the same windows
        if pending is None:
            return
        picks = []
        for s, row in zip(pending.seqs, pending.rows):
            a = accepted.get(s, 0)
            if not 0 <= a < batch.lengths[s]:
                raise ValueError(f"sequence {s}: {a} accepted drafts in a window of {batch.lengths[s]} rows")
            picks.append(row + a)
        dev = pending.state.device
        slots = torch.tensor([batch.slots[s] for s in pending.seqs], dtype=torch.int64).to(dev)
        picked = torch.tensor(picks, dtype=torch.int64).to(dev)
        for layer in self.layers:
            if layer.is_kda:
                layer.attn.commit(cache, slots, picked)

    @torch.inference_mode()
    def forward_mtp(self, batch: Batch, cache: PagedCache, *, fused: bool | None = None) -> ForwardOutput:
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (or it was not loaded)")
        fwd = ops.begin(batch, cache, fused=self.fused if fused is None else fused)
        hidden = self.mtp.forward(self.embed[fwd.token_ids], fwd, self.coll)
        return ForwardOutput(fwd.logits(hidden, self.lm_head, self.coll), hidden[: fwd.n_rows])


def accept_drafts(window: list[int], samples: list[int]) -> int:
    """Drafts accepted in one verify window: window = [last committed token, d_1, .., d_k], samples = the token
    sampled at each of its rows. d_i is accepted while every d_1..d_i equals the sample of the row before it."""
    a = 0
    while a + 1 < len(window) and window[a + 1] == samples[a]:
        a += 1
    return a
