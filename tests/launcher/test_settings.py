"""`twinspark up` / `down` settings (services/launcher/settings.py): flags and environment, the KV tier flags unset
unless given, and the command line the detached supervisor gets back."""

from __future__ import annotations

from dataclasses import replace

from services.common.flags import parse, to_argv
from services.launcher.settings import DownSettings, UpSettings


def test_up_defaults_and_environment():
    s = parse(UpSettings, [], {})
    assert (s.model, s.tp, s.host, s.port, s.device, s.drafter, s.kv_cache_dtype) == \
        (None, 1, "127.0.0.1", 8888, "cpu", "copy", "auto")
    assert (s.max_restarts, s.startup_timeout, s.stop_grace, s.random_block_size) == (5, 600.0, 10.0, 128)
    assert (s.kv_host_bytes, s.kv_disk_dir, s.kv_disk_bytes) == (None, None, None)
    assert not s.enforce_eager and not s.detach
    env = {"TWINSPARK_MODEL": "/m", "TWINSPARK_TP": "2", "TWINSPARK_PORT": "0", "TWINSPARK_DRAFTER": "none",
           "TWINSPARK_ENFORCE_EAGER": "true", "TWINSPARK_STATE_DIR": "/st", "TWINSPARK_MAX_RESTARTS": "0",
           # the ranks read these themselves: `up` does not pass them on
           "TWINSPARK_KV_HOST_BYTES": "1024", "TWINSPARK_KV_DISK_DIR": "/kv"}
    s = parse(UpSettings, [], env)
    assert (s.model, s.tp, s.port, s.drafter, s.enforce_eager, s.state_dir, s.max_restarts) == \
        ("/m", 2, 0, "none", True, "/st", 0)
    assert (s.kv_host_bytes, s.kv_disk_dir) == (None, None)


def test_tier_flags_are_set_only_as_given():
    s = parse(UpSettings, ["--kv-disk-dir", "/kv", "--kv-host-bytes", "4096"], {})
    assert (s.kv_host_bytes, s.kv_disk_dir, s.kv_disk_bytes) == (4096, "/kv", None)


def test_the_detached_supervisor_gets_the_same_settings():
    s = parse(UpSettings, ["--model", "/m", "--tp", "2", "--enforce-eager", "--random-weights", "bf16",
                           "--kv-disk-bytes", "99", "--detach"], {})
    child = replace(s, detach=False, background=True)
    argv = to_argv(child)
    assert "--detach" not in argv and "--background" in argv and "--kv-host-bytes" not in argv
    assert parse(UpSettings, argv, {"TWINSPARK_TP": "5"}) == child


def test_down():
    assert parse(DownSettings, [], {"TWINSPARK_STATE_DIR": "/st"}) == DownSettings(state_dir="/st", timeout=None)
    assert parse(DownSettings, ["--timeout", "3"], {}).timeout == 3.0
