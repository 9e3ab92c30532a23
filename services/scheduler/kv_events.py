"""The prefix index's block changes, published in vLLM's KV event format (what `vllm-router --policy kv_aware
--kv-event-source URL=tcp://HOST:PORT` subscribes to), so a router in front of several replicas routes a prompt
to the one that really holds its blocks.

Wire format (vLLM's ZMQ publisher): a PUB socket bound to `--kv-events-endpoint`; each message is three frames,
`[topic, seq as 8 bytes big-endian, payload]` (topic empty, as vLLM's default), the payload a msgpack array
`[timestamp, events, data_parallel_rank]` and each event a map tagged by its class name under "type":
- `BlockStored`: `block_hashes` (this index's 16-byte chain hashes, as bytes), `parent_block_hash` (the block
  before the first, or nil), `token_ids` (the blocks' ids, concatenated), `block_size`, `lora_id`, `medium`
  ("GPU": the ranks' pool), `lora_name`;
- `BlockRemoved`: `block_hashes`, `medium`;
- `AllBlocksCleared`: after the rank group restarted (its caches are empty).
The router hashes the token ids itself (its `--kv-event-block-size` must be the ranks' block size), so the chain
hashes only have to be stable keys for parents and removals.

What is published is what the prefix index holds: every cached block is covered by a KDA snapshot (prefix.py),
so a router that sees a prompt's first k blocks stored here may expect that replica to resume it from its deepest
snapshot at or below k blocks (a multiple of 64 positions). A message is sent per change of the index (one
snapshot taken, one evicted); PUB never blocks (a slow subscriber loses messages, and sees the gap in `seq`).

pyzmq and msgpack come with the `router` extra; they are imported only when an endpoint is given.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("twinspark.scheduler")

MEDIUM = "GPU"  # vLLM's name for the engine's own pool (here: the ranks' paged KV pool)
_SEND_HWM = 100_000  # messages queued per subscriber before PUB drops (never blocks the scheduler)


class KVEvents:
    """A ZMQ PUB socket and the encoder of vLLM's KV event batches."""

    def __init__(self, endpoint: str, block_size: int) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ValueError(f"--kv-events-endpoint needs pyzmq and msgpack ({exc}): pip install -e '.[router]'") \
                from None
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise ValueError(f"--kv-events-endpoint {endpoint}: {exc}") from None
        self.endpoint = endpoint
        self.block_size = block_size
        self.seq = 0
        log.info("publishing prefix-cache block events (vLLM's KV event format) on %s, block size %d", endpoint,
                 block_size)

    # -- events ---------------------------------------------------------------------------------------------------
    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int]) -> None:
        """Consecutive blocks of one chain joined the pool (`token_ids`: theirs, len(hashes) x block size)."""
        self._send([{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                     "token_ids": token_ids, "block_size": self.block_size, "lora_id": None, "medium": MEDIUM,
                     "lora_name": None}])

    def removed(self, hashes: list[bytes]) -> None:
        if hashes:
            self._send([{"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}])

    def cleared(self) -> None:
        self._send([{"type": "AllBlocksCleared"}])

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = self._pack([time.time(), events, None])
        try:
            self._sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload], flags=self._zmq.NOBLOCK)
        except self._zmq.Again:
            log.debug("kv events: subscriber queue full, batch %d dropped", self.seq)
        self.seq += 1

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


__all__ = ["MEDIUM", "KVEvents"]
