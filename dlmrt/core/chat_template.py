"""A model's chat template (tokenizer_config.json's `chat_template`), rendered as Hugging Face transformers does.

The template runs in jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`, a `tojson` filter
that keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`; it sees `messages`,
`add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...). Whatever the template or
the messages get wrong is an ArgumentError, so that the server answers 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dlmrt.core import json_files
from dlmrt.core.errors import ArgumentError

FILE = "tokenizer_config.json"
DEFAULT_NAME = "default"  # the named template used when a model has several


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    source: str
    special: dict[str, str] = field(default_factory=dict)
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        try:
            compiled = _SANDBOX.from_string(self.source)
        except jinja2.TemplateSyntaxError as error:
            raise ArgumentError(f"the chat template does not compile (line {error.lineno}: {error.message})") from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (each a dict with string `role` and `content`)."""
        _check_messages(messages)
        try:
            # tools and documents are None, as transformers passes them when a request has none
            return self._compiled.render(**self.special, messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as error:
            raise ArgumentError(f"the model's chat template refused the messages: "
                                f"{error.message or type(error).__name__}") from None


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The chat template in `model_dir`'s tokenizer_config.json; None when it has none."""
    path = Path(model_dir) / FILE
    if not path.exists():
        return None
    config = json_files.read(path, ArgumentError, "fix it, or remove it to serve without a chat template")
    source = _template_source(config.get("chat_template"), path)
    if source is None:
        return None
    try:
        return ChatTemplate(source, _special_tokens(config))
    except ArgumentError as error:
        raise ArgumentError(f"{path}: {error}") from None


def _template_source(value: Any, path: Path) -> str | None:
    """The template text of a `chat_template` value: a string, or a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(entry, dict) and isinstance(entry.get("name"), str)
                                       and isinstance(entry.get("template"), str) for entry in value):
        named = {entry["name"]: entry["template"] for entry in value}
        if DEFAULT_NAME not in named:
            raise ArgumentError(f"{path}: chat_template names the templates {', '.join(map(repr, named))} but "
                                f"none {DEFAULT_NAME!r}: name the one to chat with {DEFAULT_NAME!r}")
        return named[DEFAULT_NAME]
    raise ArgumentError(f"{path}: chat_template must be a string or a list of {{\"name\", \"template\"}} objects "
                        f"(both strings), not {json.dumps(value)[:80]}")


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The `*_token` entries of a tokenizer config that name a token: a string or an AddedToken's content."""
    tokens = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):  # skips flags such as add_bos_token
            tokens[key] = value
    return tokens


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ArgumentError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ArgumentError(f"messages[{index}] must be an object with string role and content, "
                                f"not {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ArgumentError(f"messages[{index}] has no {key}")
            if not isinstance(message[key], str):
                raise ArgumentError(f"messages[{index}].{key} must be a string, not {type(message[key]).__name__}")


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_SANDBOX = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
_SANDBOX.filters["tojson"] = _tojson
_SANDBOX.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
