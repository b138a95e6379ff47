"""An OpenAI completions / chat request, validated and tokenised once before anything runs.

What is checked here answers 400 (404 for an unknown model) before the tier or a decode
instance sees the request, so a bad request never holds a block or a lease: the body's
JSON, ``model``, the prompt or messages (rendered with the model's chat template),
prompt + ``max_tokens`` against ``max_model_len``, and the common sampling parameters'
ranges (vLLM's own limits). Everything else in the body goes to decode unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from prefill_node.errors import InvalidRequestError
from wavepp_gateway.api_errors import BadRequest, ModelNotFound


class Route(Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @property
    def label(self) -> str:
        return "completions" if self is Route.COMPLETIONS else "chat"


class PromptTokenizer(Protocol):
    """What the gateway needs of ``prefill_node.model.tokenizer.Tokenizer``."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class GatewayRequest:
    """A request ready to route: ``body`` as the client sent it (decode gets it with the
    gateway's fields added), ``prompt_ids`` the prompt as the model sees it."""

    route: Route
    body: Mapping[str, Any]
    prompt_ids: tuple[int, ...]
    stream: bool
    max_tokens: int
    cache_salt: str | None
    min_context: int  # prompt + the completion tokens asked for (1 when left to decode)


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def parse_request(
    route: Route,
    body: Mapping[str, Any],
    *,
    served_model: str,
    max_model_len: int,
    default_max_tokens: int,
    tokenizer: PromptTokenizer,
) -> GatewayRequest:
    """Validate and tokenise; raises BadRequest / ModelNotFound saying what to fix."""
    model = body.get("model")
    if model != served_model:
        raise ModelNotFound(
            f"The model `{model}` does not exist. Valid aliases: {served_model}.", "model"
        )
    _check_sampling(body)
    if route is Route.CHAT:
        ids = _chat_ids(body.get("messages"), tokenizer)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        ids = _completion_ids(body.get("prompt"), tokenizer)
        limit = body.get("max_tokens", default_max_tokens)
    max_tokens = max_model_len - len(ids) if limit is None else limit
    if len(ids) + max(max_tokens, 1) > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            "messages" if route is Route.CHAT else "prompt",
        )
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("cache_salt must be a non-empty string", "cache_salt")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    min_context = len(ids) + (1 if limit is None else limit)
    return GatewayRequest(route, body, tuple(ids), stream, max_tokens, salt, min_context)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_sampling(body: Mapping[str, Any]) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not _is_int(value) or value < 1):
            raise BadRequest(f"{key} must be an integer >= 1, got {value!r}", key)
    ranges = {"temperature": (0.0, None), "top_p": (1e-9, 1.0),
              "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
              "repetition_penalty": (1e-9, None), "min_p": (0.0, 1.0)}  # fmt: skip
    for key, (low, high) in ranges.items():
        value = body.get(key)
        if value is None:
            continue
        if not _is_number(value) or value < low or (high is not None and value > high):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise BadRequest(f"{key} must be a number {bounds}, got {value!r}", key)
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise BadRequest(f"top_k must be -1 (off), 0 (off) or a positive integer: {top_k!r}",
                         "top_k")  # fmt: skip
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest(f"n must be 1 behind the gateway (one prefill per request), got {n!r}",
                         "n")  # fmt: skip
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("stop must be a string or a list of strings", "stop")


def _completion_ids(prompt: Any, tokenizer: PromptTokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as the SDK may send it
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        ids = list(prompt)
    else:
        raise BadRequest("prompt must be one non-empty string or one list of token ids "
                         "(batches are not served by the gateway)", "prompt")  # fmt: skip
    if not ids:
        raise BadRequest("the prompt is empty", "prompt")
    return ids


def _chat_ids(messages: Any, tokenizer: PromptTokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    rows = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a string role and content", "messages")
        rows.append({"role": m["role"], "content": _text_content(m.get("content"))})
    try:
        ids = tokenizer.encode_chat(rows, add_generation_prompt=True)
    except InvalidRequestError as exc:
        raise BadRequest(str(exc), "messages") from None
    if not ids:
        raise BadRequest("the messages render to an empty prompt", "messages")
    return ids


def _text_content(content: Any) -> str:
    """A message's text: a string, or text parts joined with newlines (as vLLM does for
    templates that take strings); other part types are refused."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    raise BadRequest("message content must be a string or a list of text parts", "messages")
