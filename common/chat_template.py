"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it.

The template comes from `chat_template.jinja` or tokenizer_config.json's `chat_template` (a string,
or a list of named templates of which "default" is used). Templates from the Hub are untrusted code,
so they run in jinja2's immutable sandbox with the same environment transformers gives them
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does
not escape HTML), and see the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables.
The rendered text is encoded without the tokenizer's own special tokens, as transformers does: the
template writes every special token it wants.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import CheckpointError, InvalidArgumentError

_SPECIAL = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.origin = origin  # the file it came from, for errors
        self.special_tokens = special_tokens
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise CheckpointError(f"the chat template does not compile ({e})", file=origin) from e

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, or None when it has none."""
        d = Path(checkpoint_dir)
        config_path = d / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.exists() else {}
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"cannot read tokenizer config ({e})", file=str(config_path)
            ) from e
        special = {k: _content(config.get(k)) for k in _SPECIAL if _content(config.get(k))}
        jinja_path = d / "chat_template.jinja"
        if jinja_path.exists():
            return cls(jinja_path.read_text(), special, str(jinja_path))
        source = config.get("chat_template")
        if isinstance(
            source, list
        ):  # [{"name": ..., "template": ...}], as transformers saves several
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(source, special, str(config_path))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; InvalidArgumentError when the template refuses the conversation."""
        extra = dict(kwargs or {})
        for name in ("messages", "add_generation_prompt"):
            if name in extra:
                raise InvalidArgumentError(
                    "chat_template_kwargs",
                    f"must not set {name!r}: the request's own field sets it",
                )
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **extra},
            )
        except jinja2.exceptions.SecurityError as e:
            raise InvalidArgumentError("messages", f"the chat template was stopped: {e}") from None
        except Exception as e:
            # raise_exception() in the template (e.g. "roles must alternate") lands here, and so
            # does any other error of a template that does not fit the conversation.
            raise InvalidArgumentError(
                "messages", f"the model's chat template rejected the conversation: {e}"
            ) from None


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
