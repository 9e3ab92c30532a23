"""A quantized checkpoint served by `twinspark up` (TP = 2, gloo): the EXL3 tiny checkpoint (EXL3 MLPs + bf16
attention) answers the official `openai` client with the token ids offline generation gives."""

from __future__ import annotations

import openai
import pytest

from services.rank_worker.offline import GenerateRequest, generate
from tests.e2e.stack import Stack, start

PROMPT_IDS = [17, 250, 3, 99, 41, 8, 600, 12, 77]


@pytest.fixture(scope="module")
def stack(tiny_exl3, tmp_path_factory) -> Stack:
    s = start(tiny_exl3, tmp_path_factory.mktemp("exl3_stack"), tp=2, env={"TWINSPARK_DRAFTER": "none"})
    yield s
    s.down()


def test_exl3_checkpoint_served_equals_offline_generate(stack, tiny_exl3):
    client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, timeout=120)
    reply = client.completions.create(model=stack.model_name, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    expected = generate(tiny_exl3, GenerateRequest(prompt_ids=tuple(PROMPT_IDS), max_tokens=12, ignore_eos=True))
    assert reply.choices[0].token_ids == expected
