"""serve-gateway's settings (services/gateway/cli.py) from flags and the environment."""

from __future__ import annotations

import pytest

from services.common.flags import parse
from services.gateway.cli import ServeGatewaySettings
from services.gateway.limits import InputLimits


def test_defaults_environment_and_limits():
    s = parse(ServeGatewaySettings, ["--model", "/m"], {})
    assert (s.scheduler, s.host, s.port, s.keepalive_s, s.generation_config, s.log_level) == \
        ("127.0.0.1:50051", "0.0.0.0", 8888, 1.0, "auto", "info")
    assert s.input_limits() == InputLimits() and s.api_key is None and not s.allow_image_urls
    env = {"TWINSPARK_MODEL": "/m", "TWINSPARK_PORT": "9999", "TWINSPARK_MAX_BODY_BYTES": "1024",
           "TWINSPARK_ALLOW_IMAGE_URLS": "1", "TWINSPARK_SERVED_MODEL_NAME": "", "TWINSPARK_LOG_LEVEL": "WARNING"}
    s = parse(ServeGatewaySettings, ["--max-model-len", "512"], env)
    assert (s.port, s.input_limits().max_body_bytes, s.allow_image_urls, s.served_model_name, s.max_model_len) == \
        (9999, 1024, True, None, 512)
    assert s.log_level == "warning"  # uvicorn's spelling


def test_a_bad_log_level_is_a_usage_error():
    with pytest.raises(SystemExit):
        parse(ServeGatewaySettings, ["--model", "/m", "--log-level", "loud"], {})
