"""Engine <-> kv_transfer hand-off types: destinations per stage, manifests both ways."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from kv_transfer.errors import InvalidTransferRequest, LayoutMismatch
from kv_transfer.layout import KVLayout, MemoryRegion, layout_of_tensors
from kv_transfer.messages import PushDestination, StageManifest
from prefill_node.engine.types import KVPushDestination
from prefill_node.errors import InvalidKVDestinationError, InvalidRequestError
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.wire.kv_convert import manifest_from_proto, manifest_to_proto
from prefill_node.wire.kv_handoff import (
    engine_manifest,
    engine_push_destination,
    stage_push_destination,
    wire_manifest,
)

DECODE = KVLayout(0, 4, 32, 8, 2, 16, "bfloat16")


def test_push_destination_skips_decodes_cached_blocks_and_keeps_the_transfer_id():
    wire = PushDestination("r", "127.0.0.1:9", (7, 3), 30, skip_tokens=16, transfer_id="r#d#0")
    dest = engine_push_destination(wire, "decode-a", DECODE, cached_block_ids=(5, 6))
    assert dest.block_ids == (5, 6, 7, 3) and dest.layout.block_size == 8
    assert dest.layout.dtype == "bfloat16" and dest.decode_cached_tokens == 16
    assert stage_push_destination(dest, "r", 1, 30, prefill_block_size=4) == wire


def test_per_stage_block_ids_override_and_request_id_names_the_attempt_without_one():
    dest = KVPushDestination("d", "127.0.0.1:9", block_ids=(1, 2), stage_block_ids=((1, (8, 9)),))
    assert stage_push_destination(dest, "r", 0, 5, 4).block_ids == (1, 2)
    stage1 = stage_push_destination(dest, "r", 1, 5, 4)
    assert stage1.block_ids == (8, 9) and stage1.transfer_id == "r"


@pytest.mark.parametrize(
    ("dest", "match"),
    [
        (KVPushDestination("d", "", agent_metadata=b"x", block_ids=(1, 2)), "metadata_endpoint"),
        (KVPushDestination("d", "127.0.0.1:9", block_ids=(1,)), "needs 2 decode blocks"),
        (
            KVPushDestination("d", "127.0.0.1:9", block_ids=(1, 2), decode_cached_tokens=3),
            "multiple",
        ),
    ],
)
def test_bad_push_destinations_say_what_to_fix(dest, match):
    with pytest.raises(InvalidKVDestinationError, match=match):
        stage_push_destination(dest, "r", 0, 5, 4)


def test_pull_manifest_round_trips_through_the_engine_type():
    regions = tuple(MemoryRegion(4096 * (i + 1) * 1000, 20 * 2 * 4 * 2 * 8 * 4) for i in range(2))
    layout = KVLayout(2, 4, 20, 4, 2, 8, "float32", regions)
    wire = StageManifest("r", 1, 2, "127.0.0.1:9", "stage1", layout, (4, 0), 7, "L-1", 30.0)
    engine = engine_manifest(wire)
    assert engine.lease_id == "L-1" and engine.regions[1].layer == 3
    assert engine.lease_expiry_unix_s == pytest.approx(time.time() + 30.0, abs=2.0)
    back = wire_manifest(engine, "r", 2)
    assert back.layout == layout and back.lease_ttl_s == pytest.approx(30.0, abs=2.0)
    assert (back.block_ids, back.num_tokens, back.agent_name) == ((4, 0), 7, "stage1")
    with pytest.raises(InvalidTransferRequest, match="pull request"):
        wire_manifest(replace(engine, lease_id=""), "r", 2)  # a push manifest has no lease


def test_handoff_config_is_validated_once():
    with pytest.raises(InvalidRequestError, match="positive"):
        KVHandoffConfig(lease_ttl_s=0)


def test_mla_one_plane_layout_survives_the_engine_and_proto_round_trips():
    """An MLA pool ships whole per-token entries: one plane, its split named in the proto."""
    tensors = [torch.zeros(20, 1, 4, 1, 40) for _ in range(2)]
    layout = layout_of_tensors(2, tensors)
    assert (layout.planes, layout.block_bytes) == (1, 4 * 40 * 4)
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(LayoutMismatch, match="planes"):
        layout.check_compatible(KVLayout(2, 4, 20, 4, 1, 40, "float32"))  # a 2-plane pool
    wire = StageManifest("r", 1, 2, "127.0.0.1:9", "stage1", layout, (4, 0), 7, "L-1", 30.0)
    engine = engine_manifest(wire, entry_parts=(16, 8, 16))
    assert (engine.planes, engine.entry_parts) == (1, (16, 8, 16))
    assert wire_manifest(engine, "r", 2).layout == layout
    proto = manifest_to_proto(engine)
    assert proto.layout.mla.index_head_dim == 16
    assert manifest_from_proto(proto) == replace(
        engine, lease_expiry_unix_s=pytest.approx(engine.lease_expiry_unix_s, abs=1e-6)
    )


def test_hybrid_layout_names_attention_regions_and_state_slots_through_every_form():
    """A Kimi Linear stage [2, 4) (MLA layer 2, KDA layer 3): one paged region (layer 2) and
    layer 3's state matrix and conv tail; the layout survives dict, engine and proto forms,
    the decode pool's layout (all layers) is compatible, and a state slot maps byte-exactly."""
    from kv_transfer.plan import PageMap, last_token_blocks, state_descriptors
    from prefill_node.model.latent_cache import stage_cache
    from prefill_node.model.partition import LayerRange
    from prefill_node.wire.kv_handoff import hybrid_pool
    from tests.tiny_models import tiny_kimi

    config = tiny_kimi()
    kv = stage_cache(config, LayerRange(2, 4), 6, 4)
    pool = hybrid_pool(kv)
    layout = pool.layout(2, kv.tensors)
    assert (layout.paged, layout.num_blocks, layout.planes) == ((2,), 6, 1)
    assert [(s.layer, s.part, s.dtype) for s in layout.states] == [
        (3, "matrix", "float32"),
        (3, "conv", "float32"),
    ]
    matrix = kv.recurrent.states[0]
    assert layout.states[0].slot_bytes == matrix[0].numel() * 4
    assert KVLayout.from_dict(layout.to_dict()) == layout
    wire = StageManifest("r", 1, 2, "127.0.0.1:9", "stage1", layout, (4, 0), 7, "L-1", 30.0)
    engine = engine_manifest(wire, entry_parts=kv.entry_parts)
    assert [r.layer for r in engine.regions] == [2] and len(engine.states) == 2
    assert wire_manifest(engine, "r", 2).layout == layout
    assert manifest_from_proto(manifest_to_proto(engine)) == replace(
        engine, lease_expiry_unix_s=pytest.approx(engine.lease_expiry_unix_s, abs=1e-6)
    )
    first = stage_cache(config, LayerRange(0, 2), 6, 4)  # KDA layers only: no paged region
    first_layout = hybrid_pool(first).layout(0, first.tensors)
    assert first_layout.paged == () and first_layout.regions == ()
    assert KVLayout.from_dict(first_layout.to_dict()) == first_layout
    whole = stage_cache(config, LayerRange(0, 4), 9, 8)
    decode = hybrid_pool(whole).layout(0, whole.tensors)
    decode.check_compatible(layout)
    descs = state_descriptors(layout, decode, range(2, 4), 1, 5, src_is_local=True)
    slot = layout.states[0].slot_bytes
    assert descs.local[0].tolist() == [layout.states[0].region.base_addr + slot, slot, 0]
    want = decode.states_of(2, 4)[0].region.base_addr + 5 * slot
    assert descs.remote[0].tolist() == [want, slot, 0]
    # token 6 of a 7-token prompt: prefill's 2nd block (id 0), decode's 1st (id 3)
    assert last_token_blocks(PageMap((4, 0), 4), PageMap((3,), 8), 7) == (0, 3)
    plain = KVLayout(0, 4, 9, 8, 1, layout.head_dim, "float32", planes=1)  # no state regions
    with pytest.raises(LayoutMismatch, match="recurrent-state"):
        plain.check_compatible(layout)


def test_hybrid_pools_move_by_byte_copy_only():
    """A pool with recurrent layers is never staged: a bf16 decode pool (its conv tails
    differ), or an unregistered (geometry-only) pool, is a LayoutMismatch before anything
    is posted."""
    from kv_transfer.plan import PageMap
    from kv_transfer.transfer import start_transfer
    from prefill_node.model.latent_cache import stage_cache
    from prefill_node.model.partition import LayerRange
    from prefill_node.wire.kv_handoff import hybrid_pool
    from tests.tiny_models import tiny_qwen3_next

    config = tiny_qwen3_next()
    kv = stage_cache(config, LayerRange(2, 4), 6, 4)
    stage = hybrid_pool(kv).layout(2, kv.tensors)
    whole = stage_cache(config, LayerRange(0, 4), 6, 4)
    decode = hybrid_pool(whole).layout(0, whole.tensors)
    half = stage_cache(config, LayerRange(0, 4), 6, 4, torch.bfloat16)
    pages = PageMap((0, 1), 4)
    kw = {"local_layers": kv.tensors, "local_pages": pages, "remote_pages": pages}
    for local, remote, match in (
        (stage, hybrid_pool(half).layout(0, half.tensors), "recurrent-state slots differ"),
        (replace(stage, regions=()), decode, "registered"),
    ):
        with pytest.raises(LayoutMismatch, match=match):
            start_transfer(
                None,
                "WRITE",
                "decode",
                b"",
                local_layout=local,
                remote_layout=remote,
                start=0,
                end=7,
                state_slots=(1, 1),
                **kw,
            )
