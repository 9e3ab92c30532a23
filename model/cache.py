"""The physical caches one rank owns (docs/design.md §4).

- MLA layers (and the MTP layer): latent rows (kv_lora_rank per position) in fixed-size blocks, addressed through a
  sequence's block table; full-indexer layers also keep each position's indexer key and k-pool gate score. Both are
  per-position rows (`RowStore`), stored in the compute dtype or, with `kv_dtype` fp8, as e4m3 + a per-row scale.
- KDA layers: one recurrent state (local heads x dk x dv, fp32) and one short-conv history (K-1 inputs) per slot.
- Full-indexer layers also keep one compressed key per complete k-pool (`pooled`, block_size / kpool rows per
  block), written by the GPU path when a pool's last position is written (kernels/gpu/mla.py says why).
- One scratch block and one scratch slot past the ones the scheduler owns (`scratch_block`, `scratch_slot`): the
  padding rows of a CUDA-graph replay read and write there, so they can never touch a live sequence.
The scheduler decides which blocks and slots a sequence uses; this class only stores and moves rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.batch import Batch
from model.config import ModelConfig
from model.parallel import Sharding
from model.row_store import RowStore, row_bytes


@dataclass
class PendingStates:
    """One KDA layer's per-row states of the verify windows of the forward just run, until the layer's commit.
    Row `rows[i] + r` of `state` / `conv` is the state and conv history after row r of verify sequence `seqs[i]`:
    the reference keeps each window in its own stretch of rows, the fused path a row per packed row (so a CUDA
    graph's static buffers serve any mix of windows)."""
    seqs: list[int]  # batch sequence indices of the verify windows
    rows: list[int]  # each one's first row in `state` / `conv`
    state: torch.Tensor  # [N, local heads, dk, dv] fp32
    conv: torch.Tensor  # [N, K-1, channels]


class PagedCache:
    def __init__(self, cfg: ModelConfig, sharding: Sharding, *, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str, with_mtp: bool = True,
                 kv_dtype: torch.dtype | None = None) -> None:
        """kv_dtype: storage of the latent and indexer rows (None = `dtype`; torch.float8_e4m3fn = fp8 + scale)."""
        self.block_size = block_size
        self.num_blocks = num_blocks  # what the scheduler may address; the stores hold one scratch block more
        self.num_slots = num_slots
        self.scratch_block = num_blocks
        self.scratch_slot = num_slots
        mla = cfg.mla_layers + ([cfg.mtp_layer_index] if with_mtp and cfg.num_nextn_predict_layers else [])
        full = [i for i in cfg.mla_layers if cfg.indexer_types[i] == "full"] + mla[len(cfg.mla_layers):]
        rows = dict(num_blocks=num_blocks + 1, block_size=block_size, dtype=dtype, stored=kv_dtype, device=device)
        self.latent = {i: RowStore(width=cfg.kv_lora_rank, **rows) for i in mla}
        # The indexer rows are per position like the latent (key and gate score of each token), so they are KV
        # too: a third of an MLA layer's bytes per token at the release widths (2 x 128 next to 512).
        self.index_keys = {i: RowStore(width=2 * cfg.index_head_dim, **rows) for i in full}
        self.kpool = cfg.index_kpool
        self.pooled = ({i: torch.zeros(num_blocks + 1, block_size // cfg.index_kpool, cfg.index_head_dim, dtype=dtype,
                                       device=device) for i in full}
                       if block_size % cfg.index_kpool == 0 else {})
        heads = cfg.linear_num_heads * len(sharding.local) // sharding.virtual
        channels = 3 * heads * cfg.linear_head_dim
        self.kda_state = {i: torch.zeros(num_slots + 1, heads, cfg.linear_head_dim, cfg.linear_head_dim,
                                         dtype=torch.float32, device=device) for i in cfg.kda_layers}
        self.conv_state = {i: torch.zeros(num_slots + 1, cfg.linear_conv_kernel_dim - 1, channels, dtype=dtype,
                                          device=device) for i in cfg.kda_layers}
        # KDA layer -> the verify windows' per-row states of the forward just run, until the layer's commit.
        self.pending: dict[int, PendingStates] = {}

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy the KDA recurrent + conv state of slot src to slot dst for every KDA layer, pair by pair in order
        (prefix snapshots are taken and resumed this way; a state is valid only at the position it was taken)."""
        for src, dst in copies:
            if src == dst:
                continue
            for layer in self.kda_state:
                self.kda_state[layer][dst].copy_(self.kda_state[layer][src])
                self.conv_state[layer][dst].copy_(self.conv_state[layer][src])

    def block_views(self, block: int) -> list[torch.Tensor]:
        """Every slice that holds block `block` — latent and indexer rows (with their fp8 scales) and pooled keys of
        each layer — in a fixed order: what a KV tier stores for the block (services/rank_worker/kv_tiers.py)."""
        out: list[torch.Tensor] = []
        for store in [*self.latent.values(), *self.index_keys.values()]:
            out.append(store.data[block])
            if store.scale is not None:
                out.append(store.scale[block])
        return out + [p[block] for p in self.pooled.values()]

    def state_views(self, slot: int) -> list[torch.Tensor]:
        """Slot `slot`'s KDA recurrent and conv state of every layer, in a fixed order (what a KV tier stores)."""
        return [t[slot] for t in (*self.kda_state.values(), *self.conv_state.values())]

    def _addresses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in block) of every packed row."""
        pos = batch.positions
        blocks = batch.block_tables[batch.row_seq, pos // self.block_size]
        return blocks, pos % self.block_size

    def kv_bytes_per_block(self, stored: torch.dtype | None = None) -> int:
        """Bytes one block takes in every latent and indexer store together, as stored now or as `stored`."""
        stores = [*self.latent.values(), *self.index_keys.values()]
        return sum(self.block_size * row_bytes(s.width, stored or s.data.dtype) for s in stores)

    def write_rows(self, store: RowStore, batch: Batch, values: torch.Tensor) -> None:
        """Write each packed row's value at its sequence's position (padding rows past the batch are ignored)."""
        blocks, offsets = self._addresses(batch)
        store.write(blocks, offsets, values[: blocks.shape[0]])

    def read_range(self, store: RowStore, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Positions start..end-1 of one sequence -> [end - start, width] (compute dtype)."""
        first = start // self.block_size
        rows = store.read(block_table[first : -(-end // self.block_size)], end - first * self.block_size)
        return rows[start - first * self.block_size :]

    def gather_positions(self, store: RowStore, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows at `positions` (any shape, -1 = padding: row 0's value, to be masked) of one sequence ->
        [*positions.shape, width] (compute dtype)."""
        pos = positions.clamp(min=0)
        return store.gather(block_table[pos // self.block_size], pos % self.block_size)
