"""OpenAI request bodies (as vLLM's server accepts them) -> one validated ``GenerateRequest``.

The reference decode worker decodes greedily, one sequence per request: a body asking for
anything else (sampling, several choices, logprobs, stop strings, ...) is refused with
``BadRequest`` (HTTP 400) naming the parameter and what is supported, never ignored. Prompts
and chats become ids as the gateway computes them (``prefill_node.openai_api.prompt``).
Parameters with their neutral value are accepted, as are fields this server does not know
(vLLM ignores those too). An absent ``temperature`` means greedy here: the only decoding
there is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_transfer.errors import InvalidTransferRequest
from kv_transfer.messages import StageManifest
from kv_transfer.vllm_decode.params import PULL_KEY, TRACE_KEY, prompt_mismatch, pull_manifests
from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.openai_api.errors import BadRequest, unknown_model
from prefill_node.openai_api.prompt import flag, is_int, prompt_ids

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
    traceparent: str = ""  # kv_transfer_params' W3C trace context: the KV load is traced


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
    tokenizer: PromptTokenizer,
    request_id: str,
) -> GenerateRequest:
    """Validate ``body`` (parsed JSON); BadRequest / ModelNotFound say what to fix."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise unknown_model(model, served_model)
    _check_greedy(body)
    ids = prompt_ids(body, tokenizer, chat)
    _check_prompt(ids, limits)
    max_tokens = _max_tokens(body, chat, len(ids), limits)
    stream = flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    if options and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(i) for i in stop_ids):
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    manifests, refused = _kv_transfer(body.get("kv_transfer_params"), ids, request_id)
    return GenerateRequest(
        chat=chat,
        prompt_ids=tuple(ids),
        max_tokens=max_tokens,
        ignore_eos=flag(body, "ignore_eos", False),
        stop_token_ids=tuple(stop_ids),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        return_token_ids=flag(body, "return_token_ids", False),
        manifests=manifests,
        refused=refused,
        traceparent=_traceparent(body.get("kv_transfer_params")),
    )


def _traceparent(params: Any) -> str:
    value = params.get(TRACE_KEY) if isinstance(params, dict) else None
    return value if isinstance(value, str) else ""


def _check_greedy(body: Mapping[str, Any]) -> None:
    temperature = body.get("temperature")
    if temperature is not None:
        if not isinstance(temperature, int | float) or isinstance(temperature, bool):
            raise BadRequest("temperature must be a number", "temperature")
        if temperature != 0:
            raise BadRequest(
                f"temperature {temperature} is not supported: this decode worker decodes "
                f"greedily only (temperature 0). Supported: {SUPPORTED}",
                "temperature",
            )
    for key, neutral in _NEUTRAL.items():
        if key in body and not _neutral(body[key], neutral):
            raise BadRequest(
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


def _check_prompt(prompt_ids: Sequence[int], limits: PromptLimits) -> None:
    if not prompt_ids:
        raise BadRequest("the prompt is empty", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequest(
            f"token id {bad[0]} is out of vocabulary (0..{limits.vocab_size - 1})", "prompt"
        )
    if len(prompt_ids) >= limits.max_model_len:
        raise BadRequest(
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
    if not is_int(value) or value < 1:
        raise BadRequest(f"{key} must be an integer >= 1", key)
    if value > room:
        raise BadRequest(
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
        raise BadRequest("kv_transfer_params must be an object", "kv_transfer_params")
    if PULL_KEY not in params:
        return None, None
    try:
        manifests = pull_manifests(params, request_id)
    except (InvalidTransferRequest, KeyError, TypeError, ValueError) as exc:
        raise BadRequest(
            f"kv_transfer_params.{PULL_KEY} is malformed: {exc}", "kv_transfer_params"
        ) from exc
    return tuple(manifests or ()), prompt_mismatch(params, prompt_ids)
