from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckIntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageHoldings(_message.Message):
    __slots__ = ("stage", "used_blocks", "cached_blocks", "free_blocks", "kv_held_blocks", "kv_pushes", "kv_leases")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHES_FIELD_NUMBER: _ClassVar[int]
    KV_LEASES_FIELD_NUMBER: _ClassVar[int]
    stage: int
    used_blocks: int
    cached_blocks: int
    free_blocks: int
    kv_held_blocks: int
    kv_pushes: int
    kv_leases: int
    def __init__(self, stage: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., kv_held_blocks: _Optional[int] = ..., kv_pushes: _Optional[int] = ..., kv_leases: _Optional[int] = ...) -> None: ...

class IntegrityReport(_message.Message):
    __slots__ = ("ok", "error", "stages", "inflight_requests")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    stages: _containers.RepeatedCompositeFieldContainer[StageHoldings]
    inflight_requests: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageHoldings, _Mapping]]] = ..., inflight_requests: _Optional[int] = ...) -> None: ...
