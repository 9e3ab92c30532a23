"""The checkpoint's chat template, rendered with jinja2 the way transformers renders it.

Same environment as transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape `<`/`>`), so a prompt we build is
token-for-token the prompt transformers would build. The GLM-5 template also takes `from_json`, used to turn
string tool-call arguments into objects.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import GatewayError, bad_request

# Names the gateway sets itself; `chat_template_kwargs` may not replace them.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "from_json", "raise_exception",
                      "strftime_now", "bos_token", "eos_token"})


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; a prompt must contain the characters themselves.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # tokenizer_config may store {"content": "...", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, tokenizer_config: dict[str, Any] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        cfg = tokenizer_config or {}
        self._specials = {"bos_token": _token_text(cfg.get("bos_token")) or "",
                          "eos_token": _token_text(cfg.get("eos_token")) or ""}

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer_config: dict[str, Any] | None = None) -> "ChatTemplate":
        """`chat_template.jinja` (the current HF layout), else `chat_template` in tokenizer_config.json."""
        path = Path(model_dir) / "chat_template.jinja"
        if path.is_file():
            return cls(path.read_text(encoding="utf-8"), tokenizer_config)
        source = (tokenizer_config or {}).get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise FileNotFoundError(f"{model_dir} has no chat_template.jinja and tokenizer_config has no chat_template")
        return cls(source, tokenizer_config)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
        extra = dict(kwargs or {})
        for key in extra:
            if key in RESERVED or not key.isidentifier():
                raise bad_request(f"chat_template_kwargs may not set {key!r}", param=f"chat_template_kwargs.{key}")
        try:
            return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         from_json=json.loads, **self._specials, **extra)
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception() in a template is how templates reject a conversation (e.g. bad role order).
            raise bad_request(f"chat template: {exc}", param="messages") from None
        except (ValueError, TypeError, KeyError) as exc:  # e.g. from_json on arguments that are not JSON
            raise GatewayError(400, f"chat template could not render the messages: {exc}", param="messages") from None
