"""Proto <-> engine conversion of the KV hand-off types: layouts, destinations, manifests, events.

Importable by the router and decode side without the engine running: only engine dataclasses
and the generated stubs. Validation of a destination happens here, once, at the edge.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_node.engine.types import (
    KVLayoutSpec,
    KVPullDestination,
    KVPushDestination,
    MemoryRegionSpec,
    StageKVManifest,
    StateRegionSpec,
)
from prefill_node.errors import InvalidKVDestinationError
from wavepp_proto.prefill.v1 import kv_events_pb2, kv_layout_pb2

_DTYPES = {
    "float32": kv_layout_pb2.KV_DTYPE_FLOAT32,
    "float16": kv_layout_pb2.KV_DTYPE_FLOAT16,
    "bfloat16": kv_layout_pb2.KV_DTYPE_BFLOAT16,
    "float8_e4m3fn": kv_layout_pb2.KV_DTYPE_FLOAT8_E4M3,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_KINDS = {"dram": kv_layout_pb2.MEMORY_KIND_DRAM, "vram": kv_layout_pb2.MEMORY_KIND_VRAM}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_ENDPOINT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
MAX_LEASE_TTL_MS = 3_600_000


def dtype_to_proto(name: str) -> int:
    """KvDtype of a torch dtype name; InvalidKVDestinationError for an unsupported one."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidKVDestinationError(
            f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}"
        ) from None


def dtype_from_proto(value: int) -> str:
    try:
        return _DTYPE_NAMES[value]
    except KeyError:
        raise InvalidKVDestinationError(
            "layout.dtype is unset or unknown; set it to the decode pool's KvDtype"
        ) from None


_ORDER_OF_PLANES = {
    2: kv_layout_pb2.KV_MEMORY_ORDER_BLOCK_KV_TOKEN_HEAD_DIM,
    1: kv_layout_pb2.KV_MEMORY_ORDER_BLOCK_ENTRY_TOKEN,
}


def layout_to_proto(
    layout: KVLayoutSpec, entry_parts: tuple[int, ...] = ()
) -> kv_layout_pb2.KvLayout:
    """``entry_parts``: an MLA cache's (latent, rotated key, indexer key) widths."""
    msg = kv_layout_pb2.KvLayout(
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=dtype_to_proto(layout.dtype),
        num_layers=layout.num_layers,
        memory_order=_ORDER_OF_PLANES[layout.planes],
        block_bytes=layout.block_bytes,
        regions=[_region_to_proto(r) for r in layout.regions],
        recurrent_states=[_state_to_proto(r) for r in layout.states],
    )
    if entry_parts:
        latent, rope, index = entry_parts
        msg.mla.CopyFrom(
            kv_layout_pb2.MlaEntryLayout(
                kv_lora_rank=latent, qk_rope_head_dim=rope, index_head_dim=index
            )
        )
    return msg


def _planes_of(msg: kv_layout_pb2.KvLayout) -> int:
    if msg.memory_order == kv_layout_pb2.KV_MEMORY_ORDER_BLOCK_ENTRY_TOKEN:
        return 1
    return 2


def layout_from_proto(msg: kv_layout_pb2.KvLayout) -> KVLayoutSpec:
    """Validated layout; every message names the field to fix."""
    if msg.block_size <= 0:
        raise InvalidKVDestinationError("layout.block_size must be > 0 (tokens per decode block)")
    if msg.num_kv_heads <= 0 or msg.head_dim <= 0:
        raise InvalidKVDestinationError("layout.num_kv_heads and layout.head_dim must be > 0")
    if msg.memory_order not in (
        kv_layout_pb2.KV_MEMORY_ORDER_UNSPECIFIED,
        kv_layout_pb2.KV_MEMORY_ORDER_BLOCK_KV_TOKEN_HEAD_DIM,
        kv_layout_pb2.KV_MEMORY_ORDER_BLOCK_ENTRY_TOKEN,
    ):
        raise InvalidKVDestinationError(
            "layout.memory_order: only KV_MEMORY_ORDER_BLOCK_KV_TOKEN_HEAD_DIM (K/V pools) "
            "and KV_MEMORY_ORDER_BLOCK_ENTRY_TOKEN (MLA latent pools) are supported"
        )
    return KVLayoutSpec(
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        dtype=dtype_from_proto(msg.dtype),
        num_layers=msg.num_layers,
        block_bytes=msg.block_bytes,
        regions=tuple(_region_from_proto(r) for r in msg.regions),
        planes=_planes_of(msg),
        states=tuple(_state_from_proto(r) for r in msg.recurrent_states),
    )


def _region_to_proto(region: MemoryRegionSpec) -> kv_layout_pb2.MemoryRegion:
    return kv_layout_pb2.MemoryRegion(
        layer=region.layer,
        address=region.address,
        length=region.length,
        device_id=region.device_id,
        kind=_KINDS.get(region.kind, kv_layout_pb2.MEMORY_KIND_UNSPECIFIED),
    )


def _region_from_proto(msg: kv_layout_pb2.MemoryRegion) -> MemoryRegionSpec:
    if msg.kind not in _KIND_NAMES:
        raise InvalidKVDestinationError("layout.regions[].kind must be DRAM or VRAM")
    return MemoryRegionSpec(
        msg.layer, msg.address, msg.length, msg.device_id, _KIND_NAMES[msg.kind]
    )


_PARTS = {
    "matrix": kv_layout_pb2.RECURRENT_STATE_PART_MATRIX,
    "conv": kv_layout_pb2.RECURRENT_STATE_PART_CONV,
}
_PART_NAMES = {v: k for k, v in _PARTS.items()}


def _state_to_proto(state: StateRegionSpec) -> kv_layout_pb2.RecurrentStateRegion:
    return kv_layout_pb2.RecurrentStateRegion(
        layer=state.layer,
        part=_PARTS[state.part],
        address=state.address,
        length=state.length,
        device_id=state.device_id,
        kind=_KINDS.get(state.kind, kv_layout_pb2.MEMORY_KIND_UNSPECIFIED),
        slot_bytes=state.slot_bytes,
        dtype=dtype_to_proto(state.dtype),
    )


def _state_from_proto(msg: kv_layout_pb2.RecurrentStateRegion) -> StateRegionSpec:
    if msg.kind not in _KIND_NAMES or msg.part not in _PART_NAMES:
        raise InvalidKVDestinationError(
            "layout.recurrent_states[]: kind must be DRAM or VRAM and part MATRIX or CONV"
        )
    if msg.slot_bytes <= 0 or msg.length % msg.slot_bytes:
        raise InvalidKVDestinationError(
            "layout.recurrent_states[].length must be a positive multiple of slot_bytes"
        )
    return StateRegionSpec(
        msg.layer,
        _PART_NAMES[msg.part],
        msg.address,
        msg.length,
        msg.slot_bytes,
        dtype_from_proto(msg.dtype),
        msg.device_id,
        _KIND_NAMES[msg.kind],
    )


def destination_from_proto(
    msg: kv_layout_pb2.KvDestination, prompt_tokens: int
) -> KVPushDestination | KVPullDestination | None:
    """The engine destination of a request with ``prompt_tokens`` tokens, validated."""
    mode = msg.WhichOneof("mode")
    if mode is None:
        return None
    if mode == "pull":
        ttl_ms = msg.pull.lease_ttl_ms
        if ttl_ms > MAX_LEASE_TTL_MS:
            raise InvalidKVDestinationError(
                f"pull.lease_ttl_ms={ttl_ms} exceeds {MAX_LEASE_TTL_MS}; heartbeat to renew"
            )
        return KVPullDestination(lease_ttl_s=ttl_ms / 1000 if ttl_ms else None)
    push = msg.push
    if not push.agent_name:
        raise InvalidKVDestinationError("push.agent_name is empty: name the decode NIXL agent")
    if bool(push.metadata_endpoint) == bool(push.agent_metadata):
        raise InvalidKVDestinationError(
            "push: set exactly one of metadata_endpoint ('host:port') and agent_metadata"
        )
    if push.metadata_endpoint and not _valid_endpoint(push.metadata_endpoint):
        raise InvalidKVDestinationError(
            f"push.metadata_endpoint {push.metadata_endpoint!r} is not 'host:port'"
        )
    if not push.HasField("layout"):
        raise InvalidKVDestinationError("push.layout is missing: give decode's block_size, dtype")
    layout = layout_from_proto(push.layout)
    if push.decode_cached_tokens % layout.block_size or push.decode_cached_tokens >= prompt_tokens:
        raise InvalidKVDestinationError(
            f"push.decode_cached_tokens={push.decode_cached_tokens} must be a multiple of "
            f"layout.block_size={layout.block_size} and below the prompt length {prompt_tokens}"
        )
    need = (
        math.ceil(prompt_tokens / layout.block_size)
        - push.decode_cached_tokens // layout.block_size
    )
    if bool(push.block_ids) == bool(push.stage_block_ids):
        raise InvalidKVDestinationError("push: set exactly one of block_ids and stage_block_ids")
    stage_ids: list[tuple[int, tuple[int, ...]]] = []
    for entry in push.stage_block_ids:
        _check_block_ids(entry.block_ids, need, f"push.stage_block_ids[stage={entry.stage}]")
        stage_ids.append((entry.stage, tuple(entry.block_ids)))
    if len({s for s, _ in stage_ids}) != len(stage_ids):
        raise InvalidKVDestinationError("push.stage_block_ids names a stage twice")
    if push.block_ids:
        _check_block_ids(push.block_ids, need, "push.block_ids")
    return KVPushDestination(
        agent_name=push.agent_name,
        metadata_endpoint=push.metadata_endpoint,
        agent_metadata=bytes(push.agent_metadata),
        block_ids=tuple(push.block_ids),
        stage_block_ids=tuple(sorted(stage_ids)),
        layout=layout,
        decode_cached_tokens=push.decode_cached_tokens,
        transfer_id=push.transfer_id,
    )


def destination_to_proto(
    dest: KVPushDestination | KVPullDestination | None,
) -> kv_layout_pb2.KvDestination:
    if dest is None:
        return kv_layout_pb2.KvDestination()
    if isinstance(dest, KVPullDestination):
        ttl_ms = round(dest.lease_ttl_s * 1000) if dest.lease_ttl_s else 0
        return kv_layout_pb2.KvDestination(
            pull=kv_layout_pb2.KvPullDestination(lease_ttl_ms=ttl_ms)
        )
    push = kv_layout_pb2.KvPushDestination(
        agent_name=dest.agent_name,
        metadata_endpoint=dest.metadata_endpoint,
        agent_metadata=dest.agent_metadata,
        block_ids=dest.block_ids,
        stage_block_ids=[
            kv_layout_pb2.StageBlockIds(stage=s, block_ids=ids) for s, ids in dest.stage_block_ids
        ],
        decode_cached_tokens=dest.decode_cached_tokens,
        transfer_id=dest.transfer_id,
    )
    if dest.layout is not None:
        push.layout.CopyFrom(layout_to_proto(dest.layout))
    return kv_layout_pb2.KvDestination(push=push)


def _check_block_ids(ids: Sequence[int], need: int, where: str) -> None:
    if len(ids) != need:
        raise InvalidKVDestinationError(
            f"{where} has {len(ids)} ids; the prompt needs {need} decode blocks "
            "(ceil(prompt_tokens / layout.block_size) - decode_cached_tokens / block_size)"
        )
    if len(set(ids)) != len(ids):
        raise InvalidKVDestinationError(f"{where} repeats a block id; each block must be distinct")


def _valid_endpoint(endpoint: str) -> bool:
    match = _ENDPOINT.match(endpoint)
    return bool(match) and 0 < int(match.group(2)) < 65536


def manifest_to_proto(m: StageKVManifest) -> kv_layout_pb2.StageKvManifest:
    msg = kv_layout_pb2.StageKvManifest(
        stage=m.stage,
        layer_start=m.layer_start,
        layer_end=m.layer_end,
        agent_name=m.agent_name,
        metadata_endpoint=m.metadata_endpoint,
        block_ids=m.block_ids,
        num_tokens=m.num_tokens,
        layout=layout_to_proto(
            KVLayoutSpec(
                block_size=m.block_size,
                num_kv_heads=m.num_kv_heads,
                head_dim=m.head_dim,
                dtype=m.dtype,
                num_layers=m.layer_end - m.layer_start,
                regions=m.regions,
                planes=m.planes,
                states=m.states,
            ),
            m.entry_parts,
        ),
        lease_id=m.lease_id,
        pushed=m.pushed,
        lease_ttl_ms=round(m.lease_ttl_s * 1000),
    )
    if m.lease_expiry_unix_s:
        msg.lease_expiry.CopyFrom(_timestamp(m.lease_expiry_unix_s))
    return msg


def _timestamp(unix_s: float) -> Timestamp:
    """Split before scaling: seconds * 1e9 as a float loses the nanoseconds."""
    seconds = math.floor(unix_s)
    return Timestamp(seconds=seconds, nanos=min(999_999_999, round((unix_s - seconds) * 1e9)))


def manifest_from_proto(msg: kv_layout_pb2.StageKvManifest) -> StageKVManifest:
    layout = msg.layout
    expiry = 0.0
    if msg.HasField("lease_expiry"):
        expiry = msg.lease_expiry.seconds + msg.lease_expiry.nanos / 1e9
    return StageKVManifest(
        stage=msg.stage,
        layer_start=msg.layer_start,
        layer_end=msg.layer_end,
        block_ids=tuple(msg.block_ids),
        block_size=layout.block_size,
        num_tokens=msg.num_tokens,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=_DTYPE_NAMES.get(layout.dtype, ""),
        agent_name=msg.agent_name,
        metadata_endpoint=msg.metadata_endpoint,
        regions=tuple(_region_from_proto(r) for r in layout.regions),
        states=tuple(_state_from_proto(r) for r in layout.recurrent_states),
        planes=_planes_of(layout),
        entry_parts=(
            (layout.mla.kv_lora_rank, layout.mla.qk_rope_head_dim, layout.mla.index_head_dim)
            if layout.HasField("mla")
            else ()
        ),
        lease_id=msg.lease_id,
        lease_expiry_unix_s=expiry,
        pushed=msg.pushed,
        lease_ttl_s=msg.lease_ttl_ms / 1000,
    )


def event_to_proto(event: KVEvent) -> kv_events_pb2.KvEvent:
    if isinstance(event, BlockStored):
        stored = kv_events_pb2.BlocksStored(
            block_hashes=event.block_hashes,
            token_ids=event.token_ids,
            block_size=event.block_size,
        )
        if event.parent_hash is not None:
            stored.parent_block_hash = event.parent_hash
        return kv_events_pb2.KvEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        return kv_events_pb2.KvEvent(
            removed=kv_events_pb2.BlocksRemoved(block_hashes=event.block_hashes)
        )
    return kv_events_pb2.KvEvent(cleared=kv_events_pb2.AllBlocksCleared())


def event_from_proto(msg: kv_events_pb2.KvEvent) -> KVEvent:
    kind = msg.WhichOneof("event")
    if kind == "stored":
        s = msg.stored
        parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
        return BlockStored(tuple(s.block_hashes), parent, tuple(s.token_ids), s.block_size)
    if kind == "removed":
        return BlockRemoved(tuple(msg.removed.block_hashes))
    return AllBlocksCleared()


def batch_to_proto(
    sequence: int,
    events: Sequence[KVEvent],
    pipeline_id: str,
    unix_s: float,
    instance_id: str = "",
) -> kv_events_pb2.KvEventBatch:
    return kv_events_pb2.KvEventBatch(
        sequence=sequence,
        timestamp=_timestamp(unix_s),
        pipeline_id=pipeline_id,
        events=[event_to_proto(e) for e in events],
        instance_id=instance_id,
    )
