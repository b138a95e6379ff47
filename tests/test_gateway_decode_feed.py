"""What the gateway reads from a decode instance: its load from vLLM-named /metrics, and its
prefix cache from vLLM's KV events (ZMQ PUB, msgspec msgpack, vLLM 0.32's wire format) in
the router's index under the node's hashing; the fleet following both over real sockets."""

from __future__ import annotations

import asyncio
import http.server
import threading

import msgspec
import pytest

from prefill_node.core.hashing import ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from prefill_router.discovery import StaticDiscovery
from prefill_router.index import GlobalPrefixIndex
from wavepp_gateway.decode_fleet import DecodeFleet
from wavepp_gateway.decode_load import DecodeLoad, parse_load
from wavepp_gateway.metrics import GatewayMetrics
from wavepp_gateway.vllm_kv_events import (
    MalformedEventError,
    VllmEventTranslator,
    decode_message,
)

# vLLM's own message types (vllm/distributed/kv_events.py), reduced to the fields used:
# events are tagged maps, the batch an array.


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStoredV(_Event, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None


class BlockRemovedV(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None = "GPU"


class AllBlocksClearedV(_Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStoredV | BlockRemovedV | AllBlocksClearedV]
    data_parallel_rank: int | None = None


def frames(seq: int, *events) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(Batch(1.0, list(events)))]


MODEL = "tiny|decode"
PROMPT = list(range(1, 13))  # three 4-token blocks


def ours(tokens, salt=None):
    return hash_block_tokens(tokens, 4, ExtraKeys(MODEL, salt))


def test_stored_blocks_are_rehashed_with_the_nodes_hashing_chained_through_parents():
    t = VllmEventTranslator(MODEL)
    batch = decode_message(frames(7, BlockStoredV([b"v0", b"v1"], None, PROMPT[:8], 4,
                                                  extra_keys=[("t1",), None])))  # fmt: skip
    assert batch.sequence == 7
    (first,) = t.translate(batch.events)
    assert first == BlockStored(ours(PROMPT[:8], "t1"), None, tuple(PROMPT[:8]), 4)
    # the child carries no salt (vLLM salts a prompt's first block only): its chain does
    child_event = BlockStoredV([b"v2"], b"v1", PROMPT[8:], 4)
    (child,) = t.translate(decode_message(frames(8, child_event)).events)
    assert child.block_hashes == ours(PROMPT, "t1")[2:]
    assert child.parent_hash == first.block_hashes[1]
    assert t.block_size == 4
    removed = t.translate(decode_message(frames(9, BlockRemovedV([b"v2", b"zz"]))).events)
    assert removed == (BlockRemoved(ours(PROMPT, "t1")[2:]),)
    assert t.translate(decode_message(frames(10, AllBlocksClearedV())).events) == (
        AllBlocksCleared(),
    )


def test_blocks_of_an_unknown_chain_are_skipped_never_guessed():
    t = VllmEventTranslator(MODEL)
    orphan = BlockStoredV([b"v9"], b"v8", [1, 2, 3, 4], 4)
    assert t.translate(decode_message(frames(0, orphan)).events) == ()
    wrong_length = BlockStoredV([b"v0"], None, [1, 2, 3], 4)
    assert t.translate(decode_message(frames(1, wrong_length)).events) == ()


def test_the_routers_index_answers_for_decode_instances():
    t, index = VllmEventTranslator(MODEL), GlobalPrefixIndex()
    index.add_pipeline("d0")
    stored = BlockStoredV([b"a", b"b"], None, PROMPT[:8], 4)
    events = t.translate(decode_message(frames(0, stored)).events)
    index.apply("d0", 1, (AllBlocksCleared(), *events))
    assert index.match(ours(PROMPT), now=0.0) == {"d0": 2}
    assert index.match(ours(PROMPT, "other tenant"), now=0.0) == {"d0": 0}


@pytest.mark.parametrize(
    "bad", [[b"", b"\x00" * 8], [b"", b"\x00", b""], [b"", b"\x00" * 8, b"\xc1"],
            [b"", b"\x00" * 8, msgspec.msgpack.encode({"ts": 1})]],
)  # fmt: skip
def test_a_message_that_is_not_a_vllm_batch_is_refused(bad):
    with pytest.raises(MalformedEventError):
        decode_message(bad)


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
"""


def test_load_sums_engines_and_averages_kv_usage():
    assert parse_load(VLLM_METRICS) == DecodeLoad(running=4, waiting=2, kv_usage=0.5)
    assert parse_load("") == DecodeLoad()


class _Metrics(http.server.BaseHTTPRequestHandler):
    """A test double of a decode instance's /metrics and /v1/models (the process tests use
    real ones)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as real servers

    def do_GET(self):
        body = VLLM_METRICS.encode()
        if self.path == "/v1/models":
            body = b'{"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_fleet_follows_load_and_kv_events_over_real_sockets():
    import zmq

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{httpd.server_address[1]}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    async def scenario():
        fleet = DecodeFleet(StaticDiscovery([address]), MODEL, GatewayMetrics(), poll_s=0.05,
                            events_endpoint=lambda e: f"tcp://127.0.0.1:{port}")  # fmt: skip
        await fleet.start()
        try:
            seq = 0
            for _ in range(200):  # a SUB socket joins late: publish until one lands
                pub.send_multipart(frames(seq, BlockStoredV([b"a", b"b"], None, PROMPT[:8], 4)))
                seq += 1
                await asyncio.sleep(0.02)
                views = fleet.views(PROMPT, None)
                if views and views[0].cached_tokens:
                    break
            (view,) = fleet.views(PROMPT, None)
            assert (view.instance, view.cached_tokens) == (address, 8)
            assert (view.running, view.waiting, view.kv_usage) == (4, 2, 0.5)
            assert view.max_model_len == 2048 and view.fits(2048) and not view.fits(2049)
            assert fleet.views(PROMPT[:8], None)[0].cached_tokens == 7  # last token computed
            pub.send_multipart(frames(seq, BlockRemovedV([b"b"])))
            for _ in range(100):
                await asyncio.sleep(0.02)
                if fleet.views(PROMPT, None)[0].cached_tokens == 4:
                    break
            assert fleet.views(PROMPT, None)[0].cached_tokens == 4
            fleet.mark_down(address)
            assert fleet.views(PROMPT, None) == [] and fleet.num_ready() == 0
        finally:
            await fleet.aclose()

    try:
        asyncio.run(scenario())
    finally:
        pub.close(0)
        httpd.shutdown()
