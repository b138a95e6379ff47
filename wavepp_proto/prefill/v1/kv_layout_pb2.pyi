import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KvDtype]
    KV_DTYPE_FLOAT8_E4M3: _ClassVar[KvDtype]

class KvMemoryOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_MEMORY_ORDER_UNSPECIFIED: _ClassVar[KvMemoryOrder]
    KV_MEMORY_ORDER_BLOCK_KV_TOKEN_HEAD_DIM: _ClassVar[KvMemoryOrder]
    KV_MEMORY_ORDER_BLOCK_ENTRY_TOKEN: _ClassVar[KvMemoryOrder]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class RecurrentStatePart(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECURRENT_STATE_PART_UNSPECIFIED: _ClassVar[RecurrentStatePart]
    RECURRENT_STATE_PART_MATRIX: _ClassVar[RecurrentStatePart]
    RECURRENT_STATE_PART_CONV: _ClassVar[RecurrentStatePart]
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FLOAT32: KvDtype
KV_DTYPE_FLOAT16: KvDtype
KV_DTYPE_BFLOAT16: KvDtype
KV_DTYPE_FLOAT8_E4M3: KvDtype
KV_MEMORY_ORDER_UNSPECIFIED: KvMemoryOrder
KV_MEMORY_ORDER_BLOCK_KV_TOKEN_HEAD_DIM: KvMemoryOrder
KV_MEMORY_ORDER_BLOCK_ENTRY_TOKEN: KvMemoryOrder
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
RECURRENT_STATE_PART_UNSPECIFIED: RecurrentStatePart
RECURRENT_STATE_PART_MATRIX: RecurrentStatePart
RECURRENT_STATE_PART_CONV: RecurrentStatePart

class MlaEntryLayout(_message.Message):
    __slots__ = ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim")
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    def __init__(self, kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., index_head_dim: _Optional[int] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("layer", "address", "length", "device_id", "kind")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    layer: int
    address: int
    length: int
    device_id: int
    kind: MemoryKind
    def __init__(self, layer: _Optional[int] = ..., address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ..., kind: _Optional[_Union[MemoryKind, str]] = ...) -> None: ...

class RecurrentStateRegion(_message.Message):
    __slots__ = ("layer", "part", "address", "length", "device_id", "kind", "slot_bytes", "dtype")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    part: RecurrentStatePart
    address: int
    length: int
    device_id: int
    kind: MemoryKind
    slot_bytes: int
    dtype: KvDtype
    def __init__(self, layer: _Optional[int] = ..., part: _Optional[_Union[RecurrentStatePart, str]] = ..., address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ..., kind: _Optional[_Union[MemoryKind, str]] = ..., slot_bytes: _Optional[int] = ..., dtype: _Optional[_Union[KvDtype, str]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("block_size", "num_kv_heads", "head_dim", "dtype", "num_layers", "memory_order", "block_bytes", "regions", "mla", "recurrent_states")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_ORDER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    RECURRENT_STATES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: KvDtype
    num_layers: int
    memory_order: KvMemoryOrder
    block_bytes: int
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    mla: MlaEntryLayout
    recurrent_states: _containers.RepeatedCompositeFieldContainer[RecurrentStateRegion]
    def __init__(self, block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[KvDtype, str]] = ..., num_layers: _Optional[int] = ..., memory_order: _Optional[_Union[KvMemoryOrder, str]] = ..., block_bytes: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., mla: _Optional[_Union[MlaEntryLayout, _Mapping]] = ..., recurrent_states: _Optional[_Iterable[_Union[RecurrentStateRegion, _Mapping]]] = ...) -> None: ...

class StageBlockIds(_message.Message):
    __slots__ = ("stage", "block_ids")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stage: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvPushDestination(_message.Message):
    __slots__ = ("agent_name", "metadata_endpoint", "agent_metadata", "block_ids", "stage_block_ids", "layout", "decode_cached_tokens", "transfer_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STAGE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    metadata_endpoint: str
    agent_metadata: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    stage_block_ids: _containers.RepeatedCompositeFieldContainer[StageBlockIds]
    layout: KvLayout
    decode_cached_tokens: int
    transfer_id: str
    def __init__(self, agent_name: _Optional[str] = ..., metadata_endpoint: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., stage_block_ids: _Optional[_Iterable[_Union[StageBlockIds, _Mapping]]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., decode_cached_tokens: _Optional[int] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class KvPullDestination(_message.Message):
    __slots__ = ("lease_ttl_ms",)
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("push", "pull")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    push: KvPushDestination
    pull: KvPullDestination
    def __init__(self, push: _Optional[_Union[KvPushDestination, _Mapping]] = ..., pull: _Optional[_Union[KvPullDestination, _Mapping]] = ...) -> None: ...

class StageKvManifest(_message.Message):
    __slots__ = ("stage", "layer_start", "layer_end", "agent_name", "metadata_endpoint", "block_ids", "num_tokens", "layout", "lease_id", "lease_expiry", "pushed", "lease_ttl_ms")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    layer_start: int
    layer_end: int
    agent_name: str
    metadata_endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    layout: KvLayout
    lease_id: str
    lease_expiry: _timestamp_pb2.Timestamp
    pushed: bool
    lease_ttl_ms: int
    def __init__(self, stage: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., agent_name: _Optional[str] = ..., metadata_endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., lease_id: _Optional[str] = ..., lease_expiry: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., pushed: _Optional[bool] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...
