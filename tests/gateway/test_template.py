"""Unit tests: the checkpoint's chat template rendered as transformers renders it."""

from __future__ import annotations

import pytest

from services.gateway.errors import GatewayError
from services.gateway.template import ChatTemplate

HISTORY = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": [{"type": "text", "text": "U2"}]},
]


def test_render_keeps_history_reasoning(template: ChatTemplate) -> None:
    assert template.render(HISTORY) == (
        "[gMASK]<sop><|system|>\nS<|user|>\nU1<|assistant|><think>R1</think>\nA1<|user|>\nU2<|assistant|><think>")


def test_render_kwargs_thinking_off_and_cleared(template: ChatTemplate) -> None:
    out = template.render(HISTORY, kwargs={"enable_thinking": False, "clear_thinking": True})
    assert out.endswith("<think></think>\nA1<|user|>\nU2<|assistant|><think></think>")
    assert template.render(HISTORY, add_generation_prompt=False).endswith("<|user|>\nU2")


def test_tool_call_arguments_from_json_and_tojson_unescaped(template: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": '{"a": "<b>", "n": [1, "<"]}'}}]},
                {"role": "tool", "content": "r"}]
    out = template.render(messages)
    # from_json turned the string into key/value pairs; tojson kept "<" as is (no \u003c HTML escaping)
    assert "<tool_call>f<arg_key>a</arg_key><arg_value><b></arg_value>" in out
    assert '<arg_value>[1, "<"]</arg_value>' in out and "\\u003c" not in out
    assert out.endswith("<|observation|>\n<tool_response>r</tool_response><|assistant|><think>")


def test_reserved_kwargs_refused(template: ChatTemplate) -> None:
    with pytest.raises(GatewayError) as exc:
        template.render(HISTORY, kwargs={"messages": []})
    assert exc.value.status == 400 and exc.value.param == "chat_template_kwargs.messages"


def test_template_errors_are_400() -> None:
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(GatewayError) as exc:
        t.render(HISTORY)
    assert exc.value.status == 400 and "roles must alternate" in exc.value.message
