"""Tokenizer of a model directory: ``tokenizers`` for text <-> ids, jinja2 for chat templates.

Reads ``tokenizer.json`` and ``tokenizer_config.json`` (Hugging Face layout). The chat template
renders in a sandboxed jinja2 environment with the options Hugging Face uses (trim_blocks,
lstrip_blocks, ``raise_exception``, ``tojson``, ``strftime_now``), so templates written for
transformers work.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from prefill_node.errors import InvalidRequestError, ModelFileNotFoundError, ModelLoadError


class PromptTokenizer(Protocol):
    """What the servers need of a tokenizer to turn prompts into ids (``Tokenizer`` below;
    tests pass small stand-ins)."""

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]: ...


class ChatTemplateError(InvalidRequestError):
    """The chat messages do not fit the model's template (or it has none)."""


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation."""

    role: str
    content: str


class Tokenizer:
    """Encode / decode text and render chat prompts for one model directory."""

    def __init__(self, backend: Any, config: Mapping[str, Any]) -> None:
        self._backend = backend
        self._chat_template: str | None = config.get("chat_template")
        self._special = {
            key: config.get(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        eos_ids = list(config.get("eos_token_ids") or ())
        eos = config.get("eos_token")
        if isinstance(eos, str) and (eos_id := backend.token_to_id(eos)) is not None:
            eos_ids.append(eos_id)
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self._template_fn: Any = None

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ optional ``tokenizer_config.json``) from ``directory``."""
        from tokenizers import Tokenizer as Backend

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelFileNotFoundError(f"no tokenizer.json in {directory}")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise ModelLoadError(f"cannot parse {path}: {exc}") from exc
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if isinstance(config.get(key), dict):  # AddedToken serialised form
                config[key] = config[key].get("content")
        return cls(backend, config)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (including added tokens)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generated answer."""
        return self._eos_token_ids

    @property
    def bos_token(self) -> str | None:
        return self._special["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special["eos_token"]

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are matched whole."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences come out as U+FFFD."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """The text of one token as it would appear in decoded output."""
        return self.decode([token_id])

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage | Mapping[str, str]],
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for ``messages`` rendered with the model's chat template."""
        if not self._chat_template:
            raise ChatTemplateError("this model has no chat template; send plain text or ids")
        rows = [
            {"role": m.role, "content": m.content} if isinstance(m, ChatMessage) else dict(m)
            for m in messages
        ]
        try:
            return str(
                self._compiled_template().render(
                    messages=rows,
                    add_generation_prompt=add_generation_prompt,
                    **self._special,
                )
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2 errors: the messages do not fit the template
            raise ChatTemplateError(f"chat template failed to render: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[ChatMessage | Mapping[str, str]],
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (the template writes its own special tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def _compiled_template(self) -> Any:
        if self._template_fn is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ChatTemplateError(f"chat template rejected the messages: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda value, indent=None: json.dumps(
                value, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama-3.x
            self._template_fn = env.from_string(self._chat_template or "")
        return self._template_fn
