"""Prompt -> 2-stage LocalEngine -> NIXL (push / pull) -> decode worker process -> greedy tokens.

The decode worker runs in a spawned process with its own NIXL agent; the two prefill stages'
agents live in this process (one StageKVHandoff thread per stage). The decode pool's block size (8)
differs from prefill's (4), so the shipped KV goes through the token-run mapping. Generated
tokens must equal a monolithic greedy generation with the independent reference forward.
After every test each stage holds no blocks and every integrity check passes.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec
from prefill_node.engine.types import KVPullDestination, KVPushDestination, PrefillOptions
from prefill_node.errors import InvalidKVDestinationError, KVHandoffError
from prefill_node.kv_handoff.config import KVHandoffConfig
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.slow

CONFIG = tiny_llama("tiny-llama")
WEIGHTS = random_weights(CONFIG, seed=0)
SHIPPING = KVHandoffConfig(transfer_timeout_s=5.0, handshake_timeout_s=1.0, lease_ttl_s=5.0)
NEW_TOKENS = 32
SMOL_TOKENS = 16  # 135M parameters on a shared CPU: ~0.1-0.5 s per decode step


def reference_greedy(config, weights, prompt, n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        logits, _ = reference_forward(config, weights, ids)
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def used_blocks(engine: LocalEngine) -> list[int]:
    return [stage.used_blocks for stage in engine.load().stages]


def wait_idle(engine: LocalEngine, timeout_s: float = 5.0) -> None:
    """Every stage's blocks unpinned (bounded wait: pull leases end asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while any(used_blocks(engine)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert used_blocks(engine) == [0, 0]
    engine.check_integrity()  # the stages' pools, admission state and KV hand-offs
    assert engine.kv_held_blocks() == (0, 0)


@pytest.fixture(scope="module")
def decode():
    spec = DecodeWorkerSpec(model_config=CONFIG, seed=0, num_blocks=48, block_size=8, timeout_s=5)
    with DecodeWorkerProcess(spec) as worker:
        yield worker
        assert worker.stats().used_blocks == 0


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(
        stages=2, num_blocks=40, block_size=4, max_wave_tokens=8, kv_handoff=SHIPPING
    )
    engine = LocalEngine.from_weights(CONFIG, WEIGHTS, config)
    yield engine
    wait_idle(engine)
    engine.shutdown()
    engine.check_integrity()


def push_round_trip(engine, decode, request_id: str, prompt: list[int], n=NEW_TOKENS) -> list[int]:
    dest = decode.expect_push(request_id, prompt)
    result = engine.submit(prompt, PrefillOptions(request_id, kv_destination=dest)).result()
    assert [m.pushed for m in result.stage_manifests] == [True, True]
    assert used_blocks(engine) == [0, 0]  # push: unpinned before the response
    return list(decode.generate(request_id, result.first_token_id, n))


def test_push_generation_equals_monolithic_greedy(engine, decode):
    prompt = prompt_of(13, seed=1)
    assert push_round_trip(engine, decode, "push-1", prompt) == reference_greedy(
        CONFIG, WEIGHTS, prompt, NEW_TOKENS
    )
    streamed = [
        (p.stage, p.end_token, p.layer_start, p.layer_end)
        for p in decode.kv_log()[0]
        if p.request_id == "push-1"
    ]
    # waves of 8, blocks of 4: whole blocks of every layer, then the last chunk's first layer
    # group (1 of each stage's 2 layers) to the prompt's end; the final push carries the rest,
    # and the ranges its hand-off thread had not posted yet when it came (a prefix is posted).
    # The sender posts in order, but two WRITEs in flight at once may notify decode in either
    # order (each notification rides its own transfer's completion), so arrival order is not
    # part of the claim: which ranges streamed is.
    for stage, ranges in (
        (0, [(8, 0, 2), (12, 0, 2), (13, 0, 1)]),
        (1, [(8, 2, 4), (12, 2, 4), (13, 2, 3)]),
    ):
        mine = sorted(p[1:] for p in streamed if p[0] == stage)
        assert mine == ranges[: len(mine)]
    longer = prompt + prompt_of(6, seed=2)  # reuses 3 cached prefill blocks, ships them too
    tokens = push_round_trip(engine, decode, "push-2", longer)
    assert tokens == reference_greedy(CONFIG, WEIGHTS, longer, NEW_TOKENS)
    assert decode.stats().used_blocks == 0
    wait_idle(engine)


def test_the_last_chunks_first_layer_group_lands_before_that_chunks_forward_ends(engine, decode):
    """Ordering, not timing: every stage's forward of the prompt's last chunk is held before
    its last layer until decode has logged that stage's first layer group of the chunk. The
    group's WRITE goes while the forward runs, so the hold ends; shipped only after the
    forward, it could not land and the hold would time out."""
    prompt = prompt_of(37, seed=8)  # 5 chunks
    request_id = "group-1"
    pipe = threading.Lock()  # decode's pipe: one stage thread at a time
    landed: dict[int, bool] = {}

    def hold_until_landed(stage):
        lo, hi = stage.model.layer_range.start, stage.model.layer_range.end

        def pre_hook(module, args) -> None:
            if args[3].batch.chunks[-1].end != len(prompt):  # plan: not the last chunk
                return
            deadline = time.monotonic() + 3.0  # < decode's 5 s timeout
            while time.monotonic() < deadline:
                with pipe:
                    log, _ = decode.kv_log()
                if any(
                    p.request_id == request_id
                    and (p.stage, p.end_token, p.layer_start) == (stage.stage, len(prompt), lo)
                    and p.layer_end < hi
                    for p in log
                ):
                    landed[stage.stage] = True
                    return
                time.sleep(0.005)
            landed[stage.stage] = False

        return pre_hook

    hooks = [
        s.model.layers[-1].register_forward_pre_hook(hold_until_landed(s)) for s in engine.stages
    ]
    try:
        tokens = push_round_trip(engine, decode, request_id, prompt)
    finally:
        for hook in hooks:
            hook.remove()
    assert landed == {0: True, 1: True}
    assert tokens == reference_greedy(CONFIG, WEIGHTS, prompt, NEW_TOKENS)
    assert decode.stats().used_blocks == 0
    wait_idle(engine)


def test_pull_generation_equals_monolithic_greedy_and_leases_end(engine, decode):
    prompt = prompt_of(17, seed=3)
    options = PrefillOptions("pull-1", kv_destination=KVPullDestination())
    result = engine.submit(prompt, options).result()
    manifests = result.stage_manifests
    assert all(m.lease_id and m.agent_name and m.regions for m in manifests)
    assert used_blocks(engine) == [5, 5]  # leased: pinned until decode released them
    decode.pull("pull-1", prompt, manifests)
    tokens = list(decode.generate("pull-1", result.first_token_id, NEW_TOKENS))
    assert tokens == reference_greedy(CONFIG, WEIGHTS, prompt, NEW_TOKENS)
    wait_idle(engine)  # decode's release notification unpinned every stage's lease


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_or_silent_decode_fails_cleanly_and_engine_keeps_serving(engine, decode):
    prompt = prompt_of(9, seed=4)
    dest = KVPushDestination(
        agent_name="nobody", metadata_endpoint=f"127.0.0.1:{_closed_port()}", block_ids=(0, 1, 2)
    )
    started = time.monotonic()
    future = engine.submit(prompt, PrefillOptions("lost", kv_destination=dest))
    with pytest.raises(KVHandoffError, match="DecodeUnreachable"):
        future.result()
    assert time.monotonic() - started < 3
    wait_idle(engine)
    with socket.socket() as silent:  # accepts connections, never answers: too slow
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        dest = KVPushDestination(agent_name="mute", metadata_endpoint=endpoint, block_ids=(0, 1, 2))
        with pytest.raises(KVHandoffError, match="TransferTimeout"):
            engine.submit(prompt, PrefillOptions("mute", kv_destination=dest)).result()
    wait_idle(engine)
    assert push_round_trip(engine, decode, "after-loss", prompt) == reference_greedy(
        CONFIG, WEIGHTS, prompt, NEW_TOKENS
    )
    wait_idle(engine)


def test_push_through_the_grpc_api_reaches_the_decode_worker(engine, decode):
    """The destination, decode's transfer id included, crosses the proto; the request id is
    the client's own (not the transfer id)."""
    from prefill_node.client.prefill_client import PrefillClient
    from tests.grpc_harness import ServerThread

    prompt = prompt_of(11, seed=7)
    dest = decode.expect_push("grpc-1", prompt)
    with ServerThread(engine) as server, PrefillClient(server.target) as client:
        remote = client.prefill(prompt, request_id="client-req-1", kv_destination=dest)
    assert [m.pushed for m in remote.result.stage_manifests] == [True, True]
    tokens = list(decode.generate("grpc-1", remote.result.first_token_id, NEW_TOKENS))
    assert tokens == reference_greedy(CONFIG, WEIGHTS, prompt, NEW_TOKENS)
    wait_idle(engine)


def teacher_forced_greedy(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """Monolithic check of a greedy continuation in ONE forward of the full model over
    prompt + tokens[:-1] with contiguous KV: the argmax after each position. Equal to
    ``tokens`` iff every generated token is the greedy one given everything before it."""
    import torch

    from prefill_node.model.batch import ChunkBatch, ChunkSpec
    from prefill_node.model.paged_kv import PagedKVCache

    ids = prompt + tokens[:-1]
    kv = PagedKVCache.for_model(model.config, model.layer_range, len(ids), 1)
    batch = ChunkBatch((ChunkSpec(0, len(ids), tuple(range(len(ids)))),))
    hidden = model(torch.tensor(ids), batch, kv)
    logits = model.compute_logits(hidden[len(prompt) - 1 :])
    return logits.argmax(-1).tolist()


def test_rejected_destinations_fail_before_any_write(engine):
    prompt = prompt_of(9, seed=5)
    outside = KVPushDestination(
        agent_name="far", metadata_endpoint="10.1.2.3:7", block_ids=(0, 1, 2)
    )
    short = KVPushDestination(agent_name="x", metadata_endpoint="127.0.0.1:7", block_ids=(0, 1))
    with pytest.raises(InvalidKVDestinationError, match="allow-list"):
        engine.submit(prompt, PrefillOptions("outside", kv_destination=outside)).result()
    with pytest.raises(InvalidKVDestinationError, match="needs 3 decode blocks"):
        engine.submit(prompt, PrefillOptions("short", kv_destination=short)).result()
    wait_idle(engine)


def test_unread_pull_lease_expires_after_the_requests_ttl_and_unpins_every_stage():
    handoff = KVHandoffConfig(lease_ttl_s=60.0)  # node default: long
    config = EngineConfig(stages=2, num_blocks=8, block_size=4, kv_handoff=handoff)
    engine = LocalEngine.from_weights(CONFIG, WEIGHTS, config)
    try:
        options = PrefillOptions("unread", kv_destination=KVPullDestination(lease_ttl_s=0.5))
        result = engine.submit(prompt_of(10, seed=6), options).result()
        assert len({m.lease_id for m in result.stage_manifests}) == 2
        assert [m.lease_ttl_s for m in result.stage_manifests] == [0.5, 0.5]
        assert used_blocks(engine) == [3, 3]
        wait_idle(engine, timeout_s=3.0)  # nobody read them: expiry frees the blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["minimax-m2", "glm-5"])
def test_moe_and_mla_families_push_and_pull_equal_transformers_generate(tmp_path, family):
    """MiniMax-M2 (MoE, K/V blocks) and GLM-5 (MLA: one-plane latent entries shipped)."""
    from prefill_node.model.loader_hf import save_hf_checkpoint
    from tests.hf_reference import transformers_greedy
    from tests.tiny_models import tiny_glm5, tiny_minimax_m2

    config = {"minimax-m2": tiny_minimax_m2, "glm-5": tiny_glm5}[family]()
    weights = random_weights(config, seed=0)
    save_hf_checkpoint(tmp_path, config, weights)
    push_prompt, pull_prompt = prompt_of(13, seed=8), prompt_of(17, seed=9)
    spec = DecodeWorkerSpec(model_config=config, seed=0, num_blocks=48, block_size=8, timeout_s=5)
    with DecodeWorkerProcess(spec) as decode:
        local = EngineConfig(
            stages=2, num_blocks=40, block_size=4, max_wave_tokens=6, kv_handoff=SHIPPING
        )
        engine = LocalEngine.from_weights(config, weights, local)
        try:
            pushed = push_round_trip(engine, decode, f"{family}-push", push_prompt)
            options = PrefillOptions(f"{family}-pull", kv_destination=KVPullDestination())
            result = engine.submit(pull_prompt, options).result()
            assert {m.planes for m in result.stage_manifests} == {1 if config.mla else 2}
            decode.pull(f"{family}-pull", pull_prompt, result.stage_manifests)
            pulled = list(decode.generate(f"{family}-pull", result.first_token_id, NEW_TOKENS))
            wait_idle(engine)
            assert decode.stats().used_blocks == 0
        finally:
            engine.shutdown()
    assert [pushed, pulled] == transformers_greedy(tmp_path, [push_prompt, pull_prompt], NEW_TOKENS)


def test_smollm2_push_generation_equals_monolithic_greedy(default_model_dir):
    from prefill_node.model.loader_hf import load_hf_config, load_hf_weights
    from prefill_node.model.partition import LayerRange
    from prefill_node.model.stage_model import StageModel
    from prefill_node.model.tokenizer import Tokenizer

    config = load_hf_config(default_model_dir)
    weights = load_hf_weights(default_model_dir, LayerRange(0, config.num_layers), config)
    prompt = Tokenizer.from_dir(default_model_dir).encode("The capital of France is")
    spec = DecodeWorkerSpec(model_dir=str(default_model_dir), num_blocks=8, block_size=16)
    with DecodeWorkerProcess(spec) as decode:  # loads while this process builds the engine
        engine = LocalEngine.from_weights(
            config,
            weights,
            EngineConfig(stages=2, num_blocks=16, block_size=16, kv_handoff=SHIPPING),
        )
        try:
            tokens = push_round_trip(engine, decode, "smol", prompt, SMOL_TOKENS)
            assert decode.stats().used_blocks == 0
            wait_idle(engine)
        finally:
            engine.shutdown()
    monolithic = StageModel(config, LayerRange(0, config.num_layers))
    monolithic.load_weights(weights)
    assert len(tokens) == SMOL_TOKENS
    assert tokens == teacher_forced_greedy(monolithic, prompt, tokens)
