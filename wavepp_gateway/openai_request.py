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
from typing import Any

from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.openai_api.errors import BadRequest, unknown_model
from prefill_node.openai_api.prompt import flag, is_int, prompt_ids


class Route(Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"

    @property
    def label(self) -> str:
        return "completions" if self is Route.COMPLETIONS else "chat"


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
    traceparent: str = ""  # the gateway's request span (W3C) while tracing is on


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
    if body.get("model") != served_model:
        raise unknown_model(body.get("model"), served_model)
    _check_sampling(body)
    ids = prompt_ids(body, tokenizer, chat=route is Route.CHAT)
    if route is Route.CHAT:
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
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
    stream = flag(body, "stream", False)
    min_context = len(ids) + (1 if limit is None else limit)
    return GatewayRequest(route, body, tuple(ids), stream, max_tokens, salt, min_context)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_sampling(body: Mapping[str, Any]) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not is_int(value) or value < 1):
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
    if top_k is not None and (not is_int(top_k) or top_k < -1):
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
