"""Images of chat requests: fetch (data URLs; http(s) only when allowed), decode, and the checkpoint's image processor.

The processor is GLM-5's (transformers `Glm5NextImageProcessorPil`, settings from the checkpoint's
`preprocessor_config.json`): resize (bicubic) so the image fits between min and max image tokens on a
(patch x merge) grid while keeping its aspect ratio, pad to the grid with zeros, rescale to [0, 1], normalize
with the CLIP mean / std, and cut into patches ordered merge block by merge block, each patch repeated over the
temporal patch (an image is one frame). One placeholder token per merge x merge patches. Written here rather than
imported because transformers is not a runtime dependency (it would pull in the whole library for ~40 lines);
tests/gateway/test_images.py checks it against transformers' processor, value for value.

Remote URLs (`--allow-image-urls`): http(s) only, the host must resolve to public addresses only (no loopback,
private, link-local or reserved ones: the gateway must not become a way into the internal network), no redirects,
a size cap and a time limit. Decoded images are capped in pixels (decompression bombs).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import ipaddress
import json
import math
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
from PIL import Image

from .errors import GatewayError, bad_request

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_PIXELS = 50_000_000  # a decoded image larger than this is refused (PIL's bomb check is per call site)


@dataclass(frozen=True)
class ImageLimits:
    allow_urls: bool = False
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0


@dataclass
class ProcessedImage:
    pixel_values: np.ndarray  # float32 [patches, C * temporal_patch * patch * patch]
    grid: tuple[int, int, int]  # (t, h, w) in patches
    tokens: int  # placeholder tokens it takes in the prompt
    digest: bytes  # sha256 of the pixel values: the prefix cache's key for it


def smart_resize(height: int, width: int, *, factor: int, temporal: int, min_tokens: int, max_tokens: int
                 ) -> tuple[int, int]:
    """GLM-5's target canvas (a multiple of `factor` each way) within [min_tokens, max_tokens] tokens."""
    per_token = temporal * factor ** 2
    min_px, max_px = min_tokens * per_token, max_tokens * per_token

    def align(v: float) -> int:
        return math.ceil(v / factor) * factor

    frames = temporal  # one image = `temporal` identical frames
    h, w = align(height), align(width)
    if frames * h * w < min_px:
        scale = math.sqrt(min_px / (frames * height * width))
        h, w = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if frames * h * w > max_px:
        if max_px < frames * factor ** 2:
            raise ValueError(f"max_image_tokens {max_tokens} is too small for one patch")
        lo, hi, h, w = 1, height, factor, factor
        while lo <= hi:  # the tallest content that fits the budget at this aspect ratio
            ch = (lo + hi) // 2
            cw = max(1, math.floor(width * ch / height))
            if frames * align(ch) * align(cw) <= max_px:
                h, w, lo = align(ch), align(cw), ch + 1
            else:
                hi = ch - 1
    return h, w


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> "ImageProcessor | None":
        """The checkpoint's settings (`preprocessor_config.json`), or None when it has no image processor."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        fields = {k: raw[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "min_image_tokens",
                                      "max_image_tokens", "rescale_factor") if k in raw}
        for k in ("image_mean", "image_std"):
            if k in raw:
                fields[k] = tuple(raw[k])
        return cls(**fields)

    def __call__(self, image: Image.Image) -> ProcessedImage:
        rgb = np.moveaxis(np.array(image.convert("RGB")), -1, 0)  # [3, H, W] uint8
        _, height, width = rgb.shape
        factor, t = self.patch_size * self.merge_size, self.temporal_patch_size
        th, tw = smart_resize(height, width, factor=factor, temporal=t, min_tokens=self.min_image_tokens,
                              max_tokens=self.max_image_tokens)
        scale = min(th / height, tw / width)
        if t * height * width >= t * factor ** 2 * self.min_image_tokens:
            scale = min(1.0, scale)  # big enough already: never upscale, only shrink to the budget
        ch, cw = max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale)))
        if (ch, cw) != (height, width):
            resized = Image.fromarray(np.moveaxis(rgb, 0, -1)).resize((cw, ch), resample=Image.Resampling.BICUBIC)
            rgb = np.moveaxis(np.array(resized), -1, 0)
        canvas = np.pad(rgb, ((0, 0), (0, th - ch), (0, tw - cw)), mode="constant")
        x = (canvas.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean, std = np.array(self.image_mean, np.float32), np.array(self.image_std, np.float32)
        x = ((x.T - mean) / std).T
        p, m = self.patch_size, self.merge_size
        gh, gw = th // p, tw // p
        patches = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        flat = np.ascontiguousarray(patches.reshape(gh * gw, 3 * t * p * p), dtype=np.float32)
        return ProcessedImage(flat, (1, gh, gw), gh * gw // m ** 2, hashlib.sha256(flat.tobytes()).digest())


# ------------------------------------------------------------------------------------------------ fetching

def _decode(data: bytes, param: str) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_PIXELS:
            raise bad_request(f"the image is {img.width}x{img.height} pixels; at most {MAX_PIXELS} are accepted",
                              param=param, code="invalid_image")
        img.load()
    except GatewayError:
        raise
    except Exception as exc:  # noqa: BLE001 — PIL's decoders raise what they like on a malformed file
        # (OSError, ValueError, DecompressionBombError, and SyntaxError for a broken PNG chunk, struct.error, ...)
        raise bad_request(f"the image could not be decoded: {type(exc).__name__}: {exc}", param=param,
                          code="invalid_image") from None
    return img


def _data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.endswith(";base64") or not head[5:].startswith("image/"):
        raise bad_request("a data URL image must be data:image/<type>;base64,<data>", param=param,
                          code="invalid_image")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise bad_request(f"the image is larger than {limits.max_bytes} bytes", param=param, code="invalid_image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data URL is not valid base64", param=param, code="invalid_image") from None


async def _public_host(host: str, port: int, param: str) -> None:
    """Refuse a host that resolves to any non-public address."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise bad_request(f"the image host {host!r} does not resolve: {exc}", param=param,
                          code="invalid_image_url") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0])
        if not addr.is_global:
            raise bad_request(f"the image host {host!r} resolves to a non-public address ({addr}); image URLs must "
                              "point to the public internet", param=param, code="invalid_image_url")


async def _fetch(url: str, limits: ImageLimits, param: str) -> bytes:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad_request("image URLs must be data: URLs, or http(s) URLs when the server allows them", param=param,
                          code="invalid_image_url")
    await _public_host(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), param)
    try:
        async with httpx.AsyncClient(timeout=limits.timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise bad_request(f"fetching the image answered HTTP {r.status_code} (redirects are not "
                                      "followed)", param=param, code="invalid_image_url")
                data = bytearray()
                async for chunk in r.aiter_bytes():
                    data += chunk
                    if len(data) > limits.max_bytes:
                        raise bad_request(f"the image is larger than {limits.max_bytes} bytes", param=param,
                                          code="invalid_image")
                return bytes(data)
    except httpx.HTTPError as exc:
        raise bad_request(f"fetching the image failed: {type(exc).__name__}", param=param,
                          code="invalid_image_url") from None


async def load_image(url: str, limits: ImageLimits, param: str) -> Image.Image:
    """The image an `image_url` part points to, decoded."""
    if url.startswith("data:"):
        return _decode(_data_url(url, limits, param), param)
    if not limits.allow_urls:
        raise bad_request("remote image URLs are off on this server (start the gateway with --allow-image-urls); "
                          "send the image inline as a data URL (data:image/png;base64,...)", param=param,
                          code="image_urls_disabled")
    return _decode(await asyncio.wait_for(_fetch(url, limits, param), limits.timeout_s + 1), param)
