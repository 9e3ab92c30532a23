"""The gateway's image processor against transformers' GLM-5 processor, value for value, and how image URLs are
refused: remote URLs without --allow-image-urls, non-public hosts with it, broken data URLs."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from services.gateway.errors import GatewayError
from services.gateway.images import ImageLimits, ImageProcessor, load_image


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("size", [(20, 10), (300, 200), (57, 640), (1000, 1000)])
def test_matches_transformers_processor(size):
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    settings = dict(min_image_tokens=4, max_image_tokens=64)
    ref = Glm5NextImageProcessorPil(**settings)(_image(*size, seed=size[0]), return_tensors="np")
    ours = ImageProcessor(**settings)(_image(*size, seed=size[0]))
    assert tuple(ref["image_grid_thw"][0]) == ours.grid
    assert ours.tokens == ours.grid[1] * ours.grid[2] // 4 and 4 <= ours.tokens <= 64
    np.testing.assert_allclose(ours.pixel_values, ref["pixel_values"], rtol=0, atol=1e-6)


def _png(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _refusal(url: str, limits: ImageLimits) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        asyncio.run(load_image(url, limits, "messages[0].content[1].image_url.url"))
    assert info.value.status == 400
    return info.value


def test_urls_are_refused_with_the_reason():
    assert asyncio.run(load_image(_png(_image(30, 20, 1)), ImageLimits(), "p")).size == (30, 20)
    off = _refusal("https://example.com/cat.png", ImageLimits())
    assert "--allow-image-urls" in off.message and off.param == "messages[0].content[1].image_url.url"
    assert "non-public" in _refusal("http://127.0.0.1:9/cat.png", ImageLimits(allow_urls=True)).message
    assert "non-public" in _refusal("http://10.1.2.3/cat.png", ImageLimits(allow_urls=True)).message
    assert "http(s)" in _refusal("ftp://example.com/cat.png", ImageLimits(allow_urls=True)).message
    assert "base64" in _refusal("data:image/png;base64,@@@", ImageLimits()).message
    assert "decoded" in _refusal("data:image/png;base64," + base64.b64encode(b"not an image").decode(),
                                 ImageLimits()).message
    assert "larger than" in _refusal(_png(_image(300, 300, 2)), ImageLimits(max_bytes=1000)).message


def test_malformed_files_are_400s_whatever_pil_raises():
    """PIL answers a broken PNG chunk with SyntaxError (not an OSError): it was a 500. Truncated files and a
    header claiming 10^10 pixels are refused too."""
    # 8x32 16-bit grey whose IDAT holds one byte more than its length says (found by fuzzing the decoder)
    broken = "iVBORw0KGgoAAAANSUhEUgAAAAgAAAAgEAAAAABaC7pPAAAAD0lEQVR4nGNgGAWjAIeuNwAAAiAAAQTWznoAAAAASUVORK5CYII="
    raw = base64.b64decode(_png(_image(8, 8, 3)).split(",", 1)[1])
    bomb = raw[:16] + (100_000).to_bytes(4, "big") * 2 + raw[24:]
    for data in (base64.b64decode(broken), raw[:40], bomb):
        err = _refusal("data:image/png;base64," + base64.b64encode(data).decode(), ImageLimits())
        assert err.code == "invalid_image", err.message
