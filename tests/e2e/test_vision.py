"""Images through `twinspark up` (TP = 2) with the official openai client: a data-URL image is read (200, its
tokens in usage), the same image again is served from the prefix cache and another image is not, and a remote URL
without --allow-image-urls is a 400 saying why."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

pytestmark = pytest.mark.timeout(600)


def _data_url(seed: int) -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (120, 160, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _ask(client, model, url: str, question: str):
    # The image first: every cached block after it depends on which image it was.
    return client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}])


def test_image_chat_usage_cache_and_remote_url_refusal(stack_tp2):
    client = openai.OpenAI(base_url=stack_tp2.v1, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    question = " ".join(f"Describe detail number {i} of this picture." for i in range(12))
    first = _ask(client, model, _data_url(1), question)
    u = first.usage
    image_tokens = u.prompt_tokens_details.image_tokens  # OpenAI's field
    text_only = client.chat.completions.create(model=model, max_tokens=1, temperature=0,
                                               messages=[{"role": "user", "content": question}]).usage.prompt_tokens
    print(f"\nimage chat: prompt {u.prompt_tokens} tokens ({image_tokens} image tokens; {text_only} without the "
          f"image), reply {first.choices[0].message.content!r}")
    assert first.choices[0].finish_reason in ("stop", "length")
    assert 4 <= image_tokens <= 64 and u.prompt_tokens == text_only + image_tokens + 2  # + begin/end of image

    again = _ask(client, model, _data_url(1), question)
    other = _ask(client, model, _data_url(2), question)
    cached_same = again.usage.prompt_tokens_details.cached_tokens
    cached_other = other.usage.prompt_tokens_details.cached_tokens
    print(f"same image again: cached {cached_same}; another image: cached {cached_other}")
    assert again.choices[0].message.content == first.choices[0].message.content
    assert cached_same >= 256 and cached_other == 0  # the cache tells the two images apart

    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, model, "https://example.com/cat.png", question)
    err = info.value.body
    print(f"remote URL: 400 {err}")
    assert "--allow-image-urls" in err["message"] and err["param"] == "messages[0].content[0].image_url.url"
