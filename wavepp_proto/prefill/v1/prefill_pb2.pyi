import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from wavepp_proto.prefill.v1 import kv_events_pb2 as _kv_events_pb2
from wavepp_proto.prefill.v1 import kv_layout_pb2 as _kv_layout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TextPrompt(_message.Message):
    __slots__ = ("text", "apply_chat_template", "system_prompt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    text: str
    apply_chat_template: bool
    system_prompt: str
    def __init__(self, text: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., system_prompt: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "cache_salt", "top_logprobs", "kv_destination", "timeout", "priority", "tenant_id", "prefix_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: TokenIds
    text: TextPrompt
    cache_salt: str
    top_logprobs: int
    kv_destination: _kv_layout_pb2.KvDestination
    timeout: _duration_pb2.Duration
    priority: int
    tenant_id: str
    prefix_source: PrefixSource
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[_Union[TextPrompt, _Mapping]] = ..., cache_salt: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., kv_destination: _Optional[_Union[_kv_layout_pb2.KvDestination, _Mapping]] = ..., timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., priority: _Optional[int] = ..., tenant_id: _Optional[str] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ...) -> None: ...

class LeasePrefixRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "lease_ttl_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: TokenIds
    cache_salt: str
    lease_ttl_ms: int
    def __init__(self, token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class LeasePrefixResponse(_message.Message):
    __slots__ = ("stage_manifests", "cache_model_id")
    STAGE_MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    stage_manifests: _containers.RepeatedCompositeFieldContainer[_kv_layout_pb2.StageKvManifest]
    cache_model_id: str
    def __init__(self, stage_manifests: _Optional[_Iterable[_Union[_kv_layout_pb2.StageKvManifest, _Mapping]]] = ..., cache_model_id: _Optional[str] = ...) -> None: ...

class PrefixSource(_message.Message):
    __slots__ = ("address", "num_tokens")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    address: str
    num_tokens: int
    def __init__(self, address: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_seconds", "admission_seconds", "compute_seconds", "engine_seconds", "server_seconds", "fetch_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    admission_seconds: float
    compute_seconds: float
    engine_seconds: float
    server_seconds: float
    fetch_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., admission_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., engine_seconds: _Optional[float] = ..., server_seconds: _Optional[float] = ..., fetch_seconds: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "top_logprobs", "prompt_tokens", "cached_tokens", "computed_tokens", "stage_manifests", "timings", "prompt_token_ids", "served_by", "fetched_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STAGE_MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    stage_manifests: _containers.RepeatedCompositeFieldContainer[_kv_layout_pb2.StageKvManifest]
    timings: PrefillTimings
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    served_by: str
    fetched_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., stage_manifests: _Optional[_Iterable[_Union[_kv_layout_pb2.StageKvManifest, _Mapping]]] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., served_by: _Optional[str] = ..., fetched_tokens: _Optional[int] = ...) -> None: ...

class PrefillError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrefillStreamResponse(_message.Message):
    __slots__ = ("request_id", "response", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: PrefillResponse
    error: PrefillError
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[PrefillResponse, _Mapping]] = ..., error: _Optional[_Union[PrefillError, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageLoad(_message.Message):
    __slots__ = ("stage", "free_blocks", "cached_blocks", "used_blocks", "total_blocks", "busy_fraction")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    stage: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    total_blocks: int
    busy_fraction: float
    def __init__(self, stage: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., busy_fraction: _Optional[float] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("queue_depth", "inflight_requests", "inflight_tokens", "stages", "pipelines")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    inflight_requests: int
    inflight_tokens: int
    stages: _containers.RepeatedCompositeFieldContainer[StageLoad]
    pipelines: _containers.RepeatedCompositeFieldContainer[PipelineLoad]
    def __init__(self, queue_depth: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageLoad, _Mapping]]] = ..., pipelines: _Optional[_Iterable[_Union[PipelineLoad, _Mapping]]] = ...) -> None: ...

class PipelineLoad(_message.Message):
    __slots__ = ("pipeline_id", "address", "ready", "queue_depth", "inflight_requests", "inflight_tokens", "indexed_blocks", "stages")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    address: str
    ready: bool
    queue_depth: int
    inflight_requests: int
    inflight_tokens: int
    indexed_blocks: int
    stages: _containers.RepeatedCompositeFieldContainer[StageLoad]
    def __init__(self, pipeline_id: _Optional[str] = ..., address: _Optional[str] = ..., ready: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageLoad, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("pipeline_id", "reason", "prompt_tokens", "cached_tokens", "queued_seconds", "prefill_seconds", "ready_pipelines")
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_PIPELINES_FIELD_NUMBER: _ClassVar[int]
    pipeline_id: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    queued_seconds: float
    prefill_seconds: float
    ready_pipelines: int
    def __init__(self, pipeline_id: _Optional[str] = ..., reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., queued_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., ready_pipelines: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_model_len", "num_stages", "text_prompts", "server_version", "chat_template", "instance_id", "block_size", "cache_model_id", "pipeline_id", "kv_events", "router", "snapshot_interval_blocks")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_INTERVAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_model_len: int
    num_stages: int
    text_prompts: bool
    server_version: str
    chat_template: bool
    instance_id: str
    block_size: int
    cache_model_id: str
    pipeline_id: str
    kv_events: bool
    router: bool
    snapshot_interval_blocks: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_stages: _Optional[int] = ..., text_prompts: _Optional[bool] = ..., server_version: _Optional[str] = ..., chat_template: _Optional[bool] = ..., instance_id: _Optional[str] = ..., block_size: _Optional[int] = ..., cache_model_id: _Optional[str] = ..., pipeline_id: _Optional[str] = ..., kv_events: _Optional[bool] = ..., router: _Optional[bool] = ..., snapshot_interval_blocks: _Optional[int] = ...) -> None: ...
