"""Proto <-> engine conversion of prefill requests, responses and load reports.

``parse_request`` is the one place a PrefillRequest is validated: everything it can check
without the engine (prompt, vocabulary, context length, options, destination) raises a typed
InvalidRequestError whose message names the field to fix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from prefill_node.engine.types import (
    MAX_TOP_LOGPROBS,
    EngineLoad,
    PipelineLoad,
    PrefillOptions,
    PrefillResult,
    PrefillTimings,
    StageLoad,
)
from prefill_node.errors import InvalidPromptError, InvalidRequestError
from prefill_node.model.tokenizer import PromptTokenizer
from prefill_node.wire.kv_convert import (
    destination_from_proto,
    manifest_from_proto,
    manifest_to_proto,
)
from wavepp_proto.prefill.v1 import prefill_pb2

MAX_ID_CHARS = 256


class Relayed(NamedTuple):
    """A pipeline's answer as a forwarder (a router) passes it on: ``data`` the response's
    bytes as the pipeline sent them, ``response`` the same parsed (read, never re-encoded),
    ``served_by`` the pipeline that answered."""

    data: bytes
    response: prefill_pb2.PrefillResponse
    served_by: str


@dataclass(frozen=True)
class ModelLimits:
    """Model facts every request is checked against."""

    vocab_size: int
    max_model_len: int
    default_top_logprobs: int = 5


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: the engine's input plus what the response needs to echo."""

    token_ids: tuple[int, ...]
    options: PrefillOptions  # deadline_s: monotonic, the earlier of timeout and call deadline
    from_text: bool  # True: echo token_ids in the response
    timeout_s: float | None  # relative: the earlier of the request's timeout and the call's
    prefix_source: tuple[str, int] | None = None  # (address, tokens) to copy the prefix from


def parse_request(
    req: prefill_pb2.PrefillRequest,
    *,
    request_id: str,
    limits: ModelLimits,
    tokenizer: PromptTokenizer | None,
    call_remaining_s: float | None = None,
) -> ParsedRequest:
    """Validate ``req`` and convert it; ``request_id`` is the id the server settled on,
    ``call_remaining_s`` the gRPC call's time left (None: no call deadline)."""
    if len(request_id) > MAX_ID_CHARS:
        raise InvalidRequestError(f"request_id is longer than {MAX_ID_CHARS} characters")
    if len(req.cache_salt) > MAX_ID_CHARS:
        raise InvalidRequestError(f"cache_salt is longer than {MAX_ID_CHARS} characters")
    token_ids, from_text = _prompt_tokens(req, limits, tokenizer)
    top = req.top_logprobs if req.HasField("top_logprobs") else limits.default_top_logprobs
    if top > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs={top} is above the maximum {MAX_TOP_LOGPROBS}")
    timeout_s = call_remaining_s
    if req.HasField("timeout"):
        own = req.timeout.ToNanoseconds() / 1e9
        if own <= 0:
            raise InvalidRequestError("timeout must be positive; leave it unset for none")
        timeout_s = own if timeout_s is None else min(own, timeout_s)
    destination = None
    if req.HasField("kv_destination"):
        destination = destination_from_proto(req.kv_destination, len(token_ids))
    options = PrefillOptions(
        request_id=request_id,
        cache_salt=req.cache_salt or None,
        top_logprobs=top,
        kv_destination=destination,
        deadline_s=None if timeout_s is None else time.monotonic() + timeout_s,
        priority=req.priority,
        tenant=req.tenant_id or None,
    )
    source = None
    if req.HasField("prefix_source"):
        address, count = req.prefix_source.address, req.prefix_source.num_tokens
        if not address or not 0 < count < len(token_ids):
            raise InvalidRequestError(
                "prefix_source needs an address and 0 < num_tokens < the prompt's "
                f"{len(token_ids)} tokens, got {address!r} and {count}"
            )
        source = (address, count)
    return ParsedRequest(token_ids, options, from_text, timeout_s, source)


def _prompt_tokens(
    req: prefill_pb2.PrefillRequest, limits: ModelLimits, tokenizer: PromptTokenizer | None
) -> tuple[tuple[int, ...], bool]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidPromptError("the request has no prompt: set token_ids or text")
    if kind == "text":
        if not req.text.text:
            raise InvalidPromptError("text.text is empty: send a non-empty prompt")
        if tokenizer is None:
            raise InvalidPromptError("this server has no tokenizer: send token_ids instead")
        system = req.text.system_prompt
        if req.text.apply_chat_template:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": req.text.text})
            ids = tuple(tokenizer.encode_chat(messages))  # ChatTemplateError: no template
        elif system:
            raise InvalidPromptError(
                "text.system_prompt needs text.apply_chat_template: set it, or put the system "
                "text into the prompt yourself"
            )
        else:
            ids = tuple(tokenizer.encode(req.text.text))
    else:
        ids = token_ids_of(req.token_ids)
    if not ids:
        raise InvalidPromptError("the prompt is empty: send at least one token")
    if len(ids) > limits.max_model_len:
        raise InvalidPromptError(
            f"the prompt has {len(ids)} tokens; this model's context is {limits.max_model_len}: "
            "shorten it"
        )
    if max(ids) >= limits.vocab_size:
        bad = next(i for i, t in enumerate(ids) if t >= limits.vocab_size)
        raise InvalidPromptError(
            f"token id {ids[bad]} at position {bad} is outside the vocabulary "
            f"[0, {limits.vocab_size})"
        )
    return ids, kind == "text"


def token_ids_of(token_ids: prefill_pb2.TokenIds) -> tuple[int, ...]:
    """A prompt's ids off the wire, as the engine takes them (uint32: never negative). The
    servicer and bench/grpc_overhead.py's bare floor both parse with this one function."""
    return tuple(token_ids.ids)


def response_to_proto(
    result: PrefillResult, *, prompt_token_ids: Sequence[int] = (), server_s: float = 0.0
) -> prefill_pb2.PrefillResponse:
    """Filled in place: sub-messages are not built separately and copied in (the hot path)."""
    resp = prefill_pb2.PrefillResponse(
        request_id=result.request_id,
        first_token_id=result.first_token_id,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        computed_tokens=result.computed_tokens,
        prompt_token_ids=prompt_token_ids,
        served_by=result.served_by,
        fetched_tokens=result.fetched_tokens,
    )
    add_logprob = resp.top_logprobs.add
    for tok, lp in result.top_logprobs:
        add_logprob(token_id=tok, logprob=lp)
    for m in result.stage_manifests:
        resp.stage_manifests.append(manifest_to_proto(m))
    t, out = result.timings, resp.timings
    out.queue_seconds = t.queue_s
    out.admission_seconds = t.admission_s
    out.compute_seconds = t.compute_s
    out.engine_seconds = t.total_s
    out.server_seconds = server_s
    out.fetch_seconds = t.fetch_s
    return resp


def result_from_proto(msg: prefill_pb2.PrefillResponse) -> PrefillResult:
    """The engine-side view of a response (logprobs are float32 on the wire)."""
    t = msg.timings
    return PrefillResult(
        request_id=msg.request_id,
        first_token_id=msg.first_token_id,
        top_logprobs=tuple((e.token_id, e.logprob) for e in msg.top_logprobs),
        prompt_tokens=msg.prompt_tokens,
        cached_tokens=msg.cached_tokens,
        computed_tokens=msg.computed_tokens,
        timings=PrefillTimings(
            queue_s=t.queue_seconds,
            admission_s=t.admission_seconds,
            compute_s=t.compute_seconds,
            total_s=t.engine_seconds,
            fetch_s=t.fetch_seconds,
        ),
        stage_manifests=tuple(manifest_from_proto(m) for m in msg.stage_manifests),
        served_by=msg.served_by,
        fetched_tokens=msg.fetched_tokens,
    )


def _stages_to_proto(stages: Sequence[StageLoad]) -> list[prefill_pb2.StageLoad]:
    return [
        prefill_pb2.StageLoad(
            stage=s.stage,
            free_blocks=s.free_blocks,
            cached_blocks=s.cached_blocks,
            used_blocks=s.used_blocks,
            total_blocks=s.total_blocks,
            busy_fraction=s.busy_fraction,
        )
        for s in stages
    ]


def _stages_from_proto(stages: Sequence[prefill_pb2.StageLoad]) -> tuple[StageLoad, ...]:
    return tuple(
        StageLoad(s.stage, s.free_blocks, s.cached_blocks, s.used_blocks, s.total_blocks,
                  s.busy_fraction)
        for s in stages
    )  # fmt: skip


def load_to_proto(load: EngineLoad) -> prefill_pb2.LoadReport:
    return prefill_pb2.LoadReport(
        queue_depth=load.queue_depth,
        inflight_requests=load.inflight_requests,
        inflight_tokens=load.inflight_tokens,
        stages=_stages_to_proto(load.stages),
        pipelines=[
            prefill_pb2.PipelineLoad(
                pipeline_id=p.pipeline_id,
                address=p.address,
                ready=p.ready,
                queue_depth=p.queue_depth,
                inflight_requests=p.inflight_requests,
                inflight_tokens=p.inflight_tokens,
                indexed_blocks=p.indexed_blocks,
                stages=_stages_to_proto(p.stages),
            )
            for p in load.pipelines
        ],
    )


def load_from_proto(msg: prefill_pb2.LoadReport) -> EngineLoad:
    return EngineLoad(
        queue_depth=msg.queue_depth,
        inflight_requests=msg.inflight_requests,
        inflight_tokens=msg.inflight_tokens,
        stages=_stages_from_proto(msg.stages),
        pipelines=tuple(
            PipelineLoad(
                p.pipeline_id,
                p.address,
                p.ready,
                p.queue_depth,
                p.inflight_requests,
                p.inflight_tokens,
                p.indexed_blocks,
                _stages_from_proto(p.stages),
            )
            for p in msg.pipelines
        ),
    )
