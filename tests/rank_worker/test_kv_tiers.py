"""A rank's KV tier store on a real cache: entries round-trip through host RAM and disk bit for bit, a corrupt or
missing entry is refused (nothing written), the disk tier is found again by a new process with the same cache
fingerprint and not by one with another checkpoint."""

from __future__ import annotations

import torch

from services.rank_worker import fingerprint as fp
from services.rank_worker.kv_tiers import TierStore
from model.checkpoint import make_tiny
from tests.model.reference import our_model


def _cache(model):
    cache = model.new_cache(num_blocks=8, block_size=16, num_slots=4)
    g = torch.Generator().manual_seed(0)
    for views in [cache.block_views(b) for b in range(8)] + [cache.state_views(s) for s in range(4)]:
        for v in views:
            v.copy_(torch.randn(v.shape, generator=g).to(v.dtype))
    return cache


def test_entries_round_trip_and_corruption_is_refused(tiny_default, tmp_path):
    model = our_model(tiny_default)
    cache = _cache(model)
    store = TierStore(cache, host_bytes=1 << 20, disk_dir=tmp_path, disk_bytes=1 << 20, rank=0, cache_key="k" * 64)
    block, state = [v.clone() for v in cache.block_views(3)], [v.clone() for v in cache.state_views(1)]
    store.save(b"b" * 16, cache.block_views(3), {}, to_disk=False)
    store.save(b"S" + b"s" * 16, cache.state_views(1), {"state": True, "pos": 64, "chain": "ab" * 16}, to_disk=True)
    store.spill(b"b" * 16)  # host -> disk, checksum and all
    assert not store.host
    assert store.load(b"b" * 16, cache.block_views(5)) and store.load(b"S" + b"s" * 16, cache.state_views(2))
    assert all(torch.equal(a, b) for a, b in zip(block, cache.block_views(5)))
    assert all(torch.equal(a, b) for a, b in zip(state, cache.state_views(2)))

    path = next(tmp_path.glob(f"*/rank0/{(b'b' * 16).hex()}.kv"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    before = [v.clone() for v in cache.block_views(6)]
    assert not store.load(b"b" * 16, cache.block_views(6))  # corrupt: refused, nothing written
    assert not store.load(b"x" * 16, cache.block_views(6))  # missing
    assert all(torch.equal(a, b) for a, b in zip(before, cache.block_views(6)))

    again = TierStore(cache, host_bytes=0, disk_dir=tmp_path, disk_bytes=1 << 20, rank=0, cache_key="k" * 64)
    listed = {e["key"]: e for e in again.listing()}
    assert set(listed) == {b"b" * 16, b"S" + b"s" * 16}
    assert listed[b"S" + b"s" * 16]["pos"] == 64 and listed[b"S" + b"s" * 16]["chain"] == bytes.fromhex("ab" * 16)
    other = TierStore(cache, host_bytes=0, disk_dir=tmp_path, disk_bytes=1 << 20, rank=0, cache_key="o" * 64)
    assert other.listing() == []


def test_the_cache_key_tells_checkpoints_apart_but_not_pool_sizes(tiny_default, tmp_path):
    other = make_tiny(tmp_path / "seed1", seed=1)
    kw = dict(world=1, dtype=torch.float32, device="cpu", virtual_shards=4, block_size=16, kv_dtype=None)
    a = fp.settings(model_dir=tiny_default, num_blocks=100, num_slots=8, **kw)
    b = fp.settings(model_dir=tiny_default, num_blocks=500, num_slots=32, **kw)
    c = fp.settings(model_dir=other, num_blocks=100, num_slots=8, **kw)
    assert fp.cache_key(a, tiny_default) == fp.cache_key(b, tiny_default)
    assert fp.cache_key(a, tiny_default) != fp.cache_key(c, other)
