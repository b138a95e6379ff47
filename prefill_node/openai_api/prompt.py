"""A completion's ``prompt`` or a chat's ``messages`` -> the token ids the model sees.

The gateway tokenises a request once and the decode server (like ``vllm serve``) tokenises
the same chat again: both go through these functions, so the two sides compute the same ids
for the same body (a KV hand-off is refused when they differ). As vLLM does: a text prompt
honours ``add_special_tokens``, a chat honours ``add_generation_prompt``, and a message's
text parts are joined with newlines. One prompt per request (a batch of one is unwrapped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefill_node.errors import InvalidRequestError
from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.openai_api.errors import BadRequest


def is_int(value: Any) -> bool:
    """A JSON integer (``true`` is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean field of the body; anything but true / false / absent is a BadRequest."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false", key)
    return value


def prompt_ids(body: Mapping[str, Any], tokenizer: PromptTokenizer, chat: bool) -> list[int]:
    """The ids of a chat's messages or a completion's prompt; BadRequest saying what to fix."""
    ids = _chat_ids(body, tokenizer) if chat else _completion_ids(body, tokenizer)
    if not ids:
        raise BadRequest("the prompt is empty", "messages" if chat else "prompt")
    return ids


def _completion_ids(body: Mapping[str, Any], tokenizer: PromptTokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one, as the SDK may send it
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, flag(body, "add_special_tokens", True))
    if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        return list(prompt)
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise BadRequest(
            "one prompt per request is served (a string or a list of token ids), not a batch",
            "prompt",
        )
    raise BadRequest("prompt must be a non-empty string or list of token ids", "prompt")


def _chat_ids(body: Mapping[str, Any], tokenizer: PromptTokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    rows = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a string role and content", "messages")
        rows.append({"role": m["role"], "content": text_content(m.get("content"))})
    try:
        return tokenizer.encode_chat(rows, flag(body, "add_generation_prompt", True))
    except InvalidRequestError as exc:  # the template refuses these messages
        raise BadRequest(str(exc), "messages") from None


def text_content(content: Any) -> str:
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
