"""OpenAI request bodies (as vLLM's server accepts them) -> one validated ``GenerateRequest``.

The reference decode worker decodes greedily, one sequence per request: a body asking for
anything else (sampling, several choices, logprobs, stop strings, ...) is refused with
``OpenAIError`` (HTTP 400) naming the parameter and what is supported, never ignored.
Parameters with their neutral value are accepted, as are fields this server does not know
(vLLM ignores those too). An absent ``temperature`` means greedy here: the only decoding
there is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from kv_transfer.errors import InvalidTransferRequest
from kv_transfer.messages import StageManifest
from kv_transfer.vllm_decode.params import PULL_KEY, prompt_mismatch, pull_manifests

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions

# parameter -> the values that change nothing under greedy decoding of one sequence
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "top_p": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "stop": (None, "", []),
    "logit_bias": (None, {}),
    "use_beam_search": (None, False),
    "min_tokens": (None, 0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "tools": (None, []),
    "prompt_embeds": (None,),
}
SUPPORTED = (
    "greedy decoding of one sequence: temperature 0 (or absent), max_tokens, "
    "ignore_eos, stop_token_ids, stream, stream_options, return_token_ids, kv_transfer_params"
)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param",
    "code"}}`` with ``code`` the HTTP status (as vLLM's server does)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        err_type: str = "BadRequestError",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.err_type = message, param, status, err_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": int(self.status),
            }
        }


@dataclass(frozen=True)
class GenerateRequest:
    """A validated completion or chat request. ``prompt_ids`` is what the model sees;
    ``manifests`` None: compute the prompt here; ``refused`` why a load must fail."""

    chat: bool
    prompt_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    manifests: tuple[StageManifest, ...] | None
    refused: str | None


class PromptLimits:
    """What a prompt must fit: the vocabulary and the context length (prompt + new)."""

    def __init__(self, vocab_size: int, max_model_len: int) -> None:
        self.vocab_size, self.max_model_len = vocab_size, max_model_len


def parse_request(
    body: Any,
    *,
    chat: bool,
    served_model: str,
    limits: PromptLimits,
    tokenizer: Any,
    request_id: str,
) -> GenerateRequest:
    """Validate ``body`` (parsed JSON); OpenAIError says what to fix."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise OpenAIError(
            f"The model `{model}` does not exist. Valid aliases: {served_model}.",
            "model",
            HTTPStatus.NOT_FOUND,
            "NotFoundError",
        )
    _check_greedy(body)
    prompt_ids = _chat_prompt(body, tokenizer) if chat else _completion_prompt(body, tokenizer)
    _check_prompt(prompt_ids, limits)
    max_tokens = _max_tokens(body, chat, len(prompt_ids), limits)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise OpenAIError("stream_options must be an object", "stream_options")
    if options and not stream:
        raise OpenAIError("stream_options is only allowed when stream is true", "stream_options")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(i) for i in stop_ids):
        raise OpenAIError("stop_token_ids must be a list of token ids", "stop_token_ids")
    manifests, refused = _kv_transfer(body.get("kv_transfer_params"), prompt_ids, request_id)
    return GenerateRequest(
        chat=chat,
        prompt_ids=tuple(prompt_ids),
        max_tokens=max_tokens,
        ignore_eos=_bool(body, "ignore_eos"),
        stop_token_ids=tuple(stop_ids),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        return_token_ids=_bool(body, "return_token_ids"),
        manifests=manifests,
        refused=refused,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(f"{key} must be true or false", key)
    return bool(value)


def _check_greedy(body: Mapping[str, Any]) -> None:
    temperature = body.get("temperature")
    if temperature is not None:
        if not isinstance(temperature, int | float) or isinstance(temperature, bool):
            raise OpenAIError("temperature must be a number", "temperature")
        if temperature != 0:
            raise OpenAIError(
                f"temperature {temperature} is not supported: this decode worker decodes "
                f"greedily only (temperature 0). Supported: {SUPPORTED}",
                "temperature",
            )
    for key, neutral in _NEUTRAL.items():
        if key in body and not _neutral(body[key], neutral):
            raise OpenAIError(
                f"{key}={body[key]!r} is not supported by this decode worker. Supported: "
                f"{SUPPORTED}",
                key,
            )


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is one of ``allowed`` (True is not 1, False is not 0)."""
    for v in allowed:
        if v is None or value is None:
            if v is value:
                return True
        elif isinstance(value, bool) == isinstance(v, bool) and value == v:
            return True
    return False


def _completion_prompt(body: Mapping[str, Any], tokenizer: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError("prompt must not be empty", "prompt")
        add_special = body.get("add_special_tokens", True)
        return tokenizer.encode(prompt, add_special_tokens=bool(add_special))
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise OpenAIError(
            "one prompt per request is supported (a string or a list of token ids)", "prompt"
        )
    raise OpenAIError("prompt must be a non-empty string or list of token ids", "prompt")


def _chat_prompt(body: Mapping[str, Any], tokenizer: Any) -> list[int]:
    from prefill_node.model.tokenizer import ChatTemplateError

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", "messages")
    rows = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError("each message needs a role and content", "messages")
        rows.append({"role": message["role"], "content": _text_content(message.get("content"))})
    add_generation_prompt = body.get("add_generation_prompt", True)
    try:
        return tokenizer.encode_chat(rows, add_generation_prompt=bool(add_generation_prompt))
    except ChatTemplateError as exc:
        raise OpenAIError(str(exc), "messages") from exc


def _text_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise OpenAIError("message content must be text (a string or text parts)", "messages")


def _check_prompt(prompt_ids: Sequence[int], limits: PromptLimits) -> None:
    if not prompt_ids:
        raise OpenAIError("the prompt is empty", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise OpenAIError(
            f"token id {bad[0]} is out of vocabulary (0..{limits.vocab_size - 1})", "prompt"
        )
    if len(prompt_ids) >= limits.max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your prompt has {len(prompt_ids)} tokens (no room for one generated token).",
            "prompt",
        )


def _max_tokens(body: Mapping[str, Any], chat: bool, prompt_len: int, limits: PromptLimits) -> int:
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") else "max_tokens"
    value = body.get(key)
    room = limits.max_model_len - prompt_len
    if value is None:
        return room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if not _is_int(value) or value < 1:
        raise OpenAIError(f"{key} must be an integer >= 1", key)
    if value > room:
        raise OpenAIError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {prompt_len + value} tokens ({prompt_len} in the prompt, {value} "
            f"for the completion). Please reduce the length of the prompt or {key}.",
            key,
        )
    return int(value)


def _kv_transfer(
    params: Any, prompt_ids: Sequence[int], request_id: str
) -> tuple[tuple[StageManifest, ...] | None, str | None]:
    """The pull manifests in ``kv_transfer_params`` (None: compute the prompt here), and why
    the load must fail (the prompt is not the one the stages computed), as the connector."""
    if params is None:
        return None, None
    if not isinstance(params, dict):
        raise OpenAIError("kv_transfer_params must be an object", "kv_transfer_params")
    if PULL_KEY not in params:
        return None, None
    try:
        manifests = pull_manifests(params, request_id)
    except (InvalidTransferRequest, KeyError, TypeError, ValueError) as exc:
        raise OpenAIError(
            f"kv_transfer_params.{PULL_KEY} is malformed: {exc}", "kv_transfer_params"
        ) from exc
    return tuple(manifests or ()), prompt_mismatch(params, prompt_ids)
