"""A Generate request checked on its own: what is refused with which code, and what a valid one becomes."""

from __future__ import annotations

import itertools

import pytest

from services.common.tensors import to_proto
from services.scheduler.model_info import ModelInfo
from services.scheduler.validation import InvalidRequest, validate
from twinspark.v1 import generate_pb2

INFO = ModelInfo(model="tiny", fingerprint="f", world=1, num_blocks=8, block_size=16, num_slots=4, vocab_size=1000,
                 eos_ids=(999,), max_model_len=2048)


def _validate(prompt: list[int] | None = None, live: frozenset[str] = frozenset(), **fields):
    msg = generate_pb2.GenerateRequest(request_id="r", prompt_ids=to_proto(prompt or [1, 2, 3]),
                                       **{"max_tokens": 4, **fields})
    return validate(msg, INFO, grammars=None, live=live, order=itertools.count(7))


@pytest.mark.parametrize("fields, code", [
    ({"sampling": generate_pb2.Sampling(temperature=-1.0)}, "invalid_sampling"),
    ({"sampling": generate_pb2.Sampling(temperature=float("inf"))}, "invalid_sampling"),
    ({"sampling": generate_pb2.Sampling(top_p=1.5)}, "invalid_sampling"),
    ({"sampling": generate_pb2.Sampling(min_p=2.0)}, "invalid_sampling"),
    ({"sampling": generate_pb2.Sampling(top_k=-1)}, "invalid_sampling"),
    ({"sampling": generate_pb2.Sampling(frequency_penalty=-3.0)}, "invalid_penalties"),
    ({"sampling": generate_pb2.Sampling(repetition_penalty=-1.0)}, "invalid_penalties"),
    ({"sampling": generate_pb2.Sampling(logit_bias={5: 101.0})}, "invalid_penalties"),
    ({"sampling": generate_pb2.Sampling(logit_bias={1000: 1.0})}, "invalid_penalties"),
    ({"min_tokens": 5}, "invalid_penalties"),
    ({"logprobs": True, "top_logprobs": 21}, "invalid_logprobs"),
    ({"priority": 7}, "invalid_priority"),
    ({"grammar": "start: 'x'"}, "invalid_grammar"),  # no tokenizer given
    ({"max_tokens": -1}, "invalid_max_tokens"),  # 0 is a prefill only (scoring the prompt)
    ({"max_tokens": 2046}, "context_length_exceeded"),  # past the model's window
    ({"max_tokens": 126}, "context_length_exceeded"),  # inside the window, past the ranks' 128 cache positions
])
def test_refusals_name_their_code(fields, code):
    with pytest.raises(InvalidRequest) as err:
        _validate(**fields)
    assert err.value.code == code and str(err.value).startswith(f"{code}: ")


def test_prompt_ids_outside_the_vocabulary_and_a_duplicate_id():
    with pytest.raises(InvalidRequest, match="invalid_token_id: prompt token 1 is 1000"):
        _validate([1, 1000])
    with pytest.raises(InvalidRequest, match="duplicate_request_id"):
        _validate(live=frozenset({"r"}))


def test_a_valid_request_with_proto3_defaults():
    req = _validate(sampling=generate_pb2.Sampling(temperature=0.5, seed=2**64 - 1), seed_offset=2)
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 1.0, 0, 0.0, 1)  # top_p 0: off; seed wraps
    assert req.order == 7 and req.eos_ids == frozenset({999}) and req.penalties is None and req.logprobs_k == -1
    pen = _validate(sampling=generate_pb2.Sampling(logit_bias={9: 1.0, 3: -1.0}), min_tokens=2).penalties
    assert pen.spec.logit_bias == ((3, -1.0), (9, 1.0)) and pen.spec.repetition == 1.0 and not pen.spec.reads_output
