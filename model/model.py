"""GLM-5.3-Flash text model on one rank: load this rank's shard, run packed varlen forwards over paged caches.

Entry points:
- `Glm5Model.load(model_dir, ...)`
- `model.forward(batch, cache)`      target model: logits for `batch.logit_rows`, final hidden for every row
- `model.forward_mtp(batch, cache)`  MTP block: draft logits for `batch.logit_rows`
- `model.commit_verify(batch, cache, accepted)`  after sampling a batch with verify windows: keep each window's KDA
  state of its last accepted row (`accept_drafts` computes `accepted` from the window's tokens and samples)
- `model.new_cache(...)`             the physical caches sized for this rank
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import gpu
from kernels.linear import linear_fp32, pad_rows
from kernels.norms import rms_norm
from model.batch import Batch
from model.cache import PagedCache
from model.config import ModelConfig
from model import gpu_rows
from model.decoder_layer import DecoderLayer
from model.mla_attention import Selections
from model.mtp import MtpBlock
from model.parallel import Collective, Sharding
from model.vision import VisionConfig, VisionTower
from model.weights import TEXT_PREFIX, WeightReader


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab] fp32, full vocabulary on every rank
    hidden: torch.Tensor  # [T, D] final normed hidden state of every packed row


class Glm5Model:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, coll: Collective, *, load_mtp: bool = True,
                 load_target: bool = True, vision: VisionConfig | None = None) -> None:
        self.cfg = cfg
        self.coll = coll
        self.dtype = reader.dtype
        self.device = reader.device
        self.embed = reader.full(TEXT_PREFIX + "embed_tokens.weight")
        # load_target=False: embeddings, lm_head and the MTP block only (the MTP drafter's model; no `forward`).
        self.layers = [DecoderLayer(cfg, reader, f"{TEXT_PREFIX}layers.{i}.", i)
                       for i in range(cfg.num_hidden_layers)] if load_target else []
        self.norm = reader.full(TEXT_PREFIX + "norm.weight")
        self.lm_head = torch.stack(reader.split("lm_head.weight", 0))  # [S, vocab / virtual shards, D]
        mtp_prefix = f"{TEXT_PREFIX}layers.{cfg.mtp_layer_index}."
        self.mtp = (MtpBlock(cfg, reader, mtp_prefix)
                    if load_mtp and cfg.num_nextn_predict_layers and reader.has(mtp_prefix + "eh_proj.weight") else None)
        # The vision tower, where this rank runs it (rank 0; the executor broadcasts its embeddings).
        self.vision = VisionTower(vision, reader) if vision is not None else None

    @classmethod
    def load(cls, model_dir: str | Path, *, sharding: Sharding | None = None, group=None,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", load_mtp: bool = True,
             progress: bool = True, load_target: bool = True, load_vision: bool = False) -> "Glm5Model":
        sharding = sharding or Sharding()
        cfg = ModelConfig.from_pretrained(model_dir)
        vision = VisionConfig.from_hf_dict(json.loads((Path(model_dir) / "config.json").read_text())) \
            if load_vision else None
        reader = WeightReader(model_dir, sharding, dtype, torch.device(device), progress=progress)
        try:
            return cls(cfg, reader, Collective(sharding, group), load_mtp=load_mtp, load_target=load_target,
                       vision=vision)
        finally:
            reader.close()

    def new_cache(self, *, num_blocks: int, block_size: int = 16, num_slots: int = 8,
                  kv_dtype: torch.dtype | None = None) -> PagedCache:
        """kv_dtype: storage of the latent / indexer rows (None = the compute dtype; see row_store.KV_CACHE_DTYPES)."""
        return PagedCache(self.cfg, self.coll.sharding, num_blocks=num_blocks, block_size=block_size,
                          num_slots=num_slots, dtype=self.dtype, device=self.device, with_mtp=self.mtp is not None,
                          kv_dtype=kv_dtype)

    def _inputs(self, token_ids: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The first layer's input rows: token embeddings, with image placeholder rows taking their image's
        embeddings (`Batch.embeds`, on this device already). Both paths merge here, so an image row gets the same
        bits on either; on the GPU path it is a device copy per image run (no host sync)."""
        x = self.embed[token_ids]  # a gathered copy: the rows may be overwritten
        for row, e in batch.embeds or []:
            x[row : row + e.shape[0]] = e.to(x.dtype)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.coll.gather_columns([linear_fp32(hidden, w) for w in self.lm_head])

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: PagedCache) -> ForwardOutput:
        """Logits of batch.logit_rows and the final hidden state of every row: the fused GPU path on CUDA (it
        needs the decode-class sequences first, see Batch.permuted), the torch reference elsewhere."""
        if gpu.active(self.embed):
            return self.forward_gpu(batch, cache, gpu_rows.build(batch, kpool=self.cfg.index_kpool,
                                                                  block_size=cache.block_size))
        # Batch-wide tensors carry a multiple of ROW_TILE rows (zero-token padding rows that belong to no sequence)
        # so every row sees the same elementwise code paths whatever the batch size (kernels/linear.py).
        x = self._inputs(pad_rows(batch.token_ids), batch)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        selections: Selections = {}
        for layer in self.layers:
            streams = layer.forward(streams, batch, cache, selections, self.coll)
        hidden = rms_norm(streams.mean(dim=1), self.norm, self.cfg.rms_norm_eps)
        return ForwardOutput(self._logits(hidden[batch.logit_rows]), hidden[: batch.token_ids.numel()])

    @torch.inference_mode()
    def forward_gpu(self, batch: Batch, cache: PagedCache, rows: gpu_rows.GpuRows) -> ForwardOutput:
        """The fused-kernel forward (no host sync inside; a CUDA graph captures it for decode batches)."""
        from kernels.gpu import norms as gpu_norms
        streams = self._inputs(batch.token_ids, batch).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        selections: Selections = {}
        for layer in self.layers:
            streams = layer.forward_gpu(streams, batch, rows, cache, selections, self.coll)
        # The streams' mean as elementwise adds in stream order (a torch mean reduces in a shape-chosen order).
        total = streams[:, 0].float()
        for i in range(1, streams.shape[1]):
            total = total + streams[:, i].float()
        hidden = gpu_norms.rms_norm((total / streams.shape[1]).to(streams.dtype), self.norm, self.cfg.rms_norm_eps)
        return ForwardOutput(self._logits_gpu(hidden, batch.logit_rows, rows.decode_rows), hidden[: rows.n_rows])

    def _logits_gpu(self, hidden: torch.Tensor, logit_rows: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """lm_head over the wanted rows, decode-class rows with the decode schedule and prompt rows with theirs,
        returned in logit_rows' order."""
        wanted = logit_rows.cpu()  # host indices (the executor builds them on the host: no sync there)
        if torch.equal(wanted, torch.arange(hidden.shape[0])):  # every row, in order (a decode graph's batch)
            return self._vocab_gpu(hidden, decode_rows)
        decode = wanted < decode_rows
        order = torch.sort((~decode).to(torch.int8), stable=True).indices
        picked = hidden[wanted[order].to(hidden.device)]
        logits = self._vocab_gpu(picked, int(decode.sum()))
        if torch.equal(order, torch.arange(order.numel())):
            return logits
        out = torch.empty_like(logits)
        out[order.to(logits.device)] = logits
        return out

    def _vocab_gpu(self, hidden: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """fp32 logits over the full vocabulary: every local vocab shard in one batched GEMM (each with its
        one-shard schedule, kernels/gpu/gemm.py), then the ranks' columns gathered."""
        from kernels.gpu import gemm
        shards = self.lm_head.shape[0]
        return self.coll.gather_columns(gemm.bmm(hidden.unsqueeze(0).expand(shards, -1, -1), self.lm_head,
                                                 decode_rows, torch.float32))

    @torch.inference_mode()
    def commit_verify(self, batch: Batch, cache: PagedCache, accepted: dict[int, int]) -> None:
        """accepted: verify sequence index -> drafts accepted. Must follow every forward with verify windows."""
        for layer in self.layers:
            if layer.is_kda:
                layer.attn.commit(batch, cache, accepted)

    @torch.inference_mode()
    def forward_mtp(self, batch: Batch, cache: PagedCache) -> ForwardOutput:
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer (or it was not loaded)")
        if gpu.active(self.embed):
            rows = gpu_rows.build(batch, kpool=self.cfg.index_kpool, block_size=cache.block_size)
            hidden = self.mtp.forward_gpu(self.embed[batch.token_ids], batch, rows, cache, self.coll)
            return ForwardOutput(self._logits_gpu(hidden, batch.logit_rows, rows.decode_rows), hidden[: rows.n_rows])
        hidden = self.mtp.forward(self.embed[pad_rows(batch.token_ids)], batch, cache, self.coll)
        return ForwardOutput(self._logits(hidden[batch.logit_rows]), hidden[: batch.token_ids.numel()])


def accept_drafts(window: list[int], samples: list[int]) -> int:
    """Drafts accepted in one verify window: window = [last committed token, d_1, .., d_k], samples = the token
    sampled at each of its rows. d_i is accepted while every d_1..d_i equals the sample of the row before it."""
    a = 0
    while a + 1 < len(window) and window[a + 1] == samples[a]:
        a += 1
    return a
