"""serve-drafter's settings (services/drafter/cli.py) from flags and the environment."""

from __future__ import annotations

from services.common.flags import parse
from services.drafter.cli import DrafterSettings


def test_defaults_and_environment():
    s = parse(DrafterSettings, [], {})
    assert (s.host, s.port, s.method, s.model, s.device, s.mtp_history, s.log_level) == \
        ("127.0.0.1", 50061, "copy", None, "cpu", 64, "info")
    env = {"TWINSPARK_DRAFTER_HOST": "0.0.0.0", "TWINSPARK_DRAFTER_PORT": "50071", "TWINSPARK_DRAFT_METHOD": "mtp",
           "TWINSPARK_MODEL": "/m", "TWINSPARK_DEVICE": "cuda", "TWINSPARK_INTERNAL_TOKEN": "t"}
    s = parse(DrafterSettings, ["--mtp-threshold", "0.5"], env)
    assert (s.host, s.port, s.method, s.model, s.device, s.internal_token, s.mtp_threshold) == \
        ("0.0.0.0", 50071, "mtp", "/m", "cuda", "t", 0.5)
