"""serve-rank's settings (services/rank_worker/settings.py) from flags and the environment, and the shared flags'
choices against what the model library implements."""

from __future__ import annotations

import torch

from model.row_store import KV_CACHE_DTYPES
from services.common import shared_flags
from services.common.flags import parse
from services.rank_worker.settings import RankSettings


def test_defaults_and_derived_values():
    s = parse(RankSettings, ["--model", "/m"], {})
    assert (s.rank, s.world, s.host, s.port, s.device, s.kv_cache_dtype, s.num_blocks) == \
        (0, 1, "127.0.0.1", 50061, "cpu", "auto", 0)
    assert (s.block_size, s.num_slots, s.virtual_shards, s.kv_disk_bytes, s.log_level) == (16, 32, 4, 64 << 30, "info")
    assert s.compute_dtype == "float32" and s.watchdog_port == 29501 and not s.enforce_eager
    assert parse(RankSettings, ["--model", "/m", "--device", "cuda"], {}).compute_dtype == "bfloat16"


def test_environment_names_are_the_deployment_ones():
    env = {"TWINSPARK_MODEL": "/m", "TWINSPARK_TP": "2", "TWINSPARK_RANK": "1", "TWINSPARK_RANK_HOST": "0.0.0.0",
           "TWINSPARK_RANK_PORT": "50062", "TWINSPARK_PEER_PORT": "7000", "TWINSPARK_DTYPE": "float16",
           "TWINSPARK_ENFORCE_EAGER": "1", "TWINSPARK_KV_DISK_DIR": "/kv", "TWINSPARK_LOG_LEVEL": "DEBUG"}
    s = parse(RankSettings, [], env)
    assert (s.model, s.world, s.rank, s.host, s.port, s.watchdog_port) == ("/m", 2, 1, "0.0.0.0", 50062, 7000)
    assert (s.compute_dtype, s.enforce_eager, s.kv_disk_dir, s.log_level) == ("float16", True, "/kv", "debug")
    assert parse(RankSettings, ["--world", "4", "--log-level", "warning"], env).world == 4


def test_shared_choices_are_the_model_library_ones():
    assert set(shared_flags.KV_CACHE_DTYPE.choices or ()) == set(KV_CACHE_DTYPES)
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in shared_flags.DTYPES)
