"""Conversions between the engine's KV hand-off types (engine/types.py) and kv_transfer's.

The engine boundary (and the gRPC proto) speaks ``KVPushDestination`` / ``StageKVManifest``;
the NIXL library speaks ``PushDestination`` / ``StageManifest``. These functions are the only
place the two meet, so neither package imports the other's types elsewhere.

A hybrid model's cache (``RecurrentStateCache``: paged blocks for the attention layers,
recurrent-state snapshot slots per block for the recurrent layers) registers as a
``HybridPool`` (``hybrid_pool``); its manifests name the attention layers' regions and,
per recurrent layer, its state regions (``StageKVManifest.states``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kv_transfer.errors import InvalidTransferRequest
from kv_transfer.layout import HybridPool, KVLayout, MemoryRegion, StateRegion
from kv_transfer.messages import PushDestination, StageManifest
from prefill_node.engine.types import (
    KVLayoutSpec,
    KVPushDestination,
    MemoryRegionSpec,
    StageKVManifest,
    StateRegionSpec,
)
from prefill_node.errors import InvalidKVDestinationError

if TYPE_CHECKING:
    from prefill_node.model.latent_cache import StageCache


def hybrid_pool(kv: StageCache) -> HybridPool | None:
    """What a hybrid stage cache registers besides its attention layers' tensors: each
    recurrent layer's snapshot tensors (state matrix, conv tail); None for other caches."""
    from prefill_node.model.recurrent_cache import RecurrentStateCache  # torch: only here

    if not isinstance(kv, RecurrentStateCache):
        return None
    snaps = kv.recurrent
    states = tuple(
        (layer, part, tensor)
        for i, layer in enumerate(snaps.layers)
        for part, tensor in (("matrix", snaps.states[i]), ("conv", snaps.tails[i]))
    )
    geometry = KVLayout(
        kv.layer_range.start,
        kv.layer_range.end,
        kv.num_blocks,
        kv.block_size,
        kv.num_kv_heads,
        kv.head_dim,
        str(kv.dtype).removeprefix("torch."),
        planes=kv.planes,
    )
    return HybridPool(kv.layer_range.end, tuple(kv.layers), states, geometry)


def _state_specs(layout: KVLayout) -> tuple[StateRegionSpec, ...]:
    return tuple(
        StateRegionSpec(
            s.layer,
            s.part,
            s.region.base_addr,
            s.region.length,
            s.slot_bytes,
            s.dtype,
            s.region.device_id,
            s.region.mem_type.lower(),
        )
        for s in layout.states
    )


def stage_push_destination(
    dest: KVPushDestination, request_id: str, stage: int, num_tokens: int, prefill_block_size: int
) -> PushDestination:
    """What stage ``stage`` WRITEs to: decode's blocks for tokens ``[cached, num_tokens)``.

    ``dest.block_ids`` (or this stage's ``stage_block_ids`` entry) hold one decode block per
    prompt block, the cached prefix included; the prefix blocks are not written. Without
    ``dest.transfer_id`` the request id names the attempt (what decode must then expect).
    """
    if not dest.metadata_endpoint:
        raise InvalidKVDestinationError(
            "push: inline agent_metadata is not supported by this node; give metadata_endpoint"
        )
    block_ids = dict(dest.stage_block_ids).get(stage, dest.block_ids)
    block_size = dest.layout.block_size if dest.layout is not None else prefill_block_size
    if dest.decode_cached_tokens % block_size:
        raise InvalidKVDestinationError(
            f"push.decode_cached_tokens={dest.decode_cached_tokens} is not a multiple of the "
            f"decode block size {block_size}"
        )
    need = -(-num_tokens // block_size)
    if len(block_ids) != need:
        raise InvalidKVDestinationError(
            f"push destination for stage {stage} has {len(block_ids)} block ids; a "
            f"{num_tokens}-token prompt needs {need} decode blocks of {block_size} tokens"
        )
    try:
        return PushDestination(
            request_id=request_id,
            endpoint=dest.metadata_endpoint,
            block_ids=tuple(block_ids[dest.decode_cached_tokens // block_size :]),
            num_tokens=num_tokens,
            skip_tokens=dest.decode_cached_tokens,
            transfer_id=dest.transfer_id or request_id,
        )
    except InvalidTransferRequest as exc:
        raise InvalidKVDestinationError(str(exc)) from exc


def engine_push_destination(
    wire: PushDestination,
    agent_name: str,
    layout: KVLayout,
    cached_block_ids: tuple[int, ...] = (),
) -> KVPushDestination:
    """Decode side: the engine destination for a receiver's ``expect`` result.

    ``layout``: the decode pool's (the receiver's). ``cached_block_ids``: decode blocks
    already holding the ``wire.skip_tokens`` prefix.
    """
    spec = KVLayoutSpec(
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        block_bytes=layout.block_bytes,
        planes=layout.planes,
        states=_state_specs(layout),
    )
    return KVPushDestination(
        agent_name=agent_name,
        metadata_endpoint=wire.endpoint,
        block_ids=tuple(cached_block_ids) + wire.block_ids,
        layout=spec,
        decode_cached_tokens=wire.skip_tokens,
        transfer_id=wire.transfer_id,
    )


def engine_manifest(
    wire: StageManifest, pushed: bool = False, entry_parts: tuple[int, ...] = ()
) -> StageKVManifest:
    """A stage's lease (pull) or finished WRITE (push) as the engine reports it;
    ``entry_parts``: the cache's MLA entry split (empty for K/V pools)."""
    layout = wire.layout
    return StageKVManifest(
        stage=wire.stage,
        layer_start=layout.layer_start,
        layer_end=layout.layer_end,
        block_ids=wire.block_ids,
        block_size=layout.block_size,
        num_tokens=wire.num_tokens,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        agent_name=wire.agent_name,
        metadata_endpoint=wire.endpoint,
        regions=tuple(
            MemoryRegionSpec(layer, r.base_addr, r.length, r.device_id, r.mem_type.lower())
            for layer, r in zip(layout.paged, layout.regions, strict=True)
        ),
        states=_state_specs(layout),
        lease_id=wire.lease_id,
        lease_expiry_unix_s=time.time() + wire.lease_ttl_s if wire.lease_id else 0.0,
        pushed=pushed,
        lease_ttl_s=wire.lease_ttl_s if wire.lease_id else 0.0,
        planes=layout.planes,
        entry_parts=entry_parts,
    )


def wire_manifest(m: StageKVManifest, request_id: str, num_stages: int) -> StageManifest:
    """Decode side: a pull manifest from the engine's (or the proto's) StageKVManifest.

    The pool's block count is implied by the region length; the remaining TTL by the expiry.
    """
    regions = tuple(
        MemoryRegion(r.address, r.length, r.device_id, r.kind.upper()) for r in m.regions
    )
    states = tuple(
        StateRegion(
            s.layer,
            s.part,
            MemoryRegion(s.address, s.length, s.device_id, s.kind.upper()),
            s.slot_bytes,
            s.dtype,
        )
        for s in m.states
    )
    if not (regions or states) or not m.lease_id:
        raise InvalidTransferRequest(
            f"stage {m.stage} manifest has no memory regions or no lease: was it a pull request?"
        )
    block_bytes = m.planes * m.block_size * m.num_kv_heads * m.head_dim * _elem_size(m.dtype)
    paged = tuple(r.layer for r in m.regions)
    hybrid = bool(states) or paged != tuple(range(m.layer_start, m.layer_end))
    layout = KVLayout(
        m.layer_start,
        m.layer_end,
        regions[0].length // block_bytes if regions else states[0].num_slots,
        m.block_size,
        m.num_kv_heads,
        m.head_dim,
        m.dtype,
        regions,
        m.planes,
        paged_layers=paged if hybrid else None,
        states=states,
    )
    return StageManifest(
        request_id=request_id,
        stage=m.stage,
        num_stages=num_stages,
        endpoint=m.metadata_endpoint,
        agent_name=m.agent_name,
        layout=layout,
        block_ids=m.block_ids,
        num_tokens=m.num_tokens,
        lease_id=m.lease_id,
        lease_ttl_s=max(m.lease_expiry_unix_s - time.time(), 0.001),
    )


def _elem_size(dtype: str) -> int:
    from kv_transfer.layout import DTYPE_SIZES

    if dtype not in DTYPE_SIZES:
        raise InvalidTransferRequest(f"unknown KV dtype {dtype!r} in manifest")
    return DTYPE_SIZES[dtype]
