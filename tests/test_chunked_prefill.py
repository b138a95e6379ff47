"""Chunked prefill over paged KV == one full forward: any chunk boundaries, shuffled and
per-stage block tables, several chunks per batch, and prefix reuse with copy-on-write."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.errors import InvariantError
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.reference import reference_forward
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import random_weights
from tests.tiny_models import tiny_qwen3

BLOCK = 4
NUM_BLOCKS = 40
ATOL = 2e-5

CONFIG = tiny_qwen3("tiny-chunked", max_position_embeddings=512)
WEIGHTS = random_weights(CONFIG, seed=11)
RANGES = split_layers(CONFIG.num_layers, 2)
STAGES = [StageModel.random_init(CONFIG, lr, seed=11) for lr in RANGES]
TOKENS = torch.randint(
    0, CONFIG.vocab_size, (45,), generator=torch.Generator().manual_seed(2)
).tolist()


def new_caches() -> list[PagedKVCache]:
    return [PagedKVCache.for_model(CONFIG, lr, NUM_BLOCKS, BLOCK) for lr in RANGES]


def run_batch(
    specs_per_stage: list[list[ChunkSpec]], tokens: list[int], caches
) -> list[torch.Tensor]:
    """One forward through every stage (each stage its own tables); returns each stage's hidden."""
    x: torch.Tensor = torch.tensor(tokens)
    hiddens = []
    for stage, kv, specs in zip(STAGES, caches, specs_per_stage, strict=True):
        x = stage(x, ChunkBatch(tuple(specs)), kv)
        hiddens.append(x)
    return hiddens


def full_forward(tokens: list[int]):
    caches = new_caches()
    n = -(-len(tokens) // BLOCK)
    table = tuple(range(n))
    hiddens = run_batch([[ChunkSpec(0, len(tokens), table)]] * len(STAGES), tokens, caches)
    return hiddens, caches, table


FULL_HIDDEN, FULL_CACHES, FULL_TABLE = full_forward(TOKENS)


def assert_kv_equal(caches, tables, ref_caches, ref_table, num_tokens):
    for kv, ref, table in zip(caches, ref_caches, tables, strict=True):
        for layer in kv.layer_range:
            k, v = kv.read(layer, table, num_tokens)
            rk, rv = ref.read(layer, ref_table, num_tokens)
            torch.testing.assert_close(k, rk, atol=ATOL, rtol=0)
            torch.testing.assert_close(v, rv, atol=ATOL, rtol=0)


def test_full_forward_matches_reference():
    logits = STAGES[-1].compute_logits(FULL_HIDDEN[-1][-1:])[0]
    ref_logits, ref_kv = reference_forward(CONFIG, WEIGHTS, TOKENS)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    for kv in FULL_CACHES:
        for layer in kv.layer_range:
            k, v = kv.read(layer, FULL_TABLE, len(TOKENS))
            torch.testing.assert_close(k, ref_kv[layer][0], atol=1e-4, rtol=0)
            torch.testing.assert_close(v, ref_kv[layer][1], atol=1e-4, rtol=0)


@settings(max_examples=15, deadline=None)
@given(
    cuts=st.sets(st.integers(1, len(TOKENS) - 1), max_size=6),
    perm_seed=st.integers(0, 2**16),
)
def test_arbitrary_chunks_and_shuffled_tables_match_full_forward(cuts, perm_seed):
    bounds = [0, *sorted(cuts), len(TOKENS)]
    g = torch.Generator().manual_seed(perm_seed)
    n = -(-len(TOKENS) // BLOCK)
    tables = [tuple(torch.randperm(NUM_BLOCKS, generator=g)[:n].tolist()) for _ in STAGES]
    caches = new_caches()
    for s, e in zip(bounds, bounds[1:], strict=False):
        specs = [[ChunkSpec(s, e - s, t)] for t in tables]
        hiddens = run_batch(specs, TOKENS[s:e], caches)
        for h, full in zip(hiddens, FULL_HIDDEN, strict=True):
            torch.testing.assert_close(h, full[s:e], atol=ATOL, rtol=0)
    assert_kv_equal(caches, tables, FULL_CACHES, FULL_TABLE, len(TOKENS))


def test_several_chunks_in_one_batch():
    """Batch 1: A[0,10) and B[0,7). Batch 2: B[7,20), A[10,23) and A[23,45) (A twice)."""
    tokens_b = TOKENS[::-1][:20]
    full_b, caches_b_ref, table_b_ref = full_forward(tokens_b)
    ta, tb = tuple(range(0, 12)), tuple(range(39, 33, -1))  # disjoint, B descending
    caches = new_caches()
    run_batch([[ChunkSpec(0, 10, ta), ChunkSpec(0, 7, tb)]] * 2, TOKENS[:10] + tokens_b[:7], caches)
    specs = [ChunkSpec(7, 13, tb), ChunkSpec(10, 13, ta), ChunkSpec(23, 22, ta)]
    hiddens = run_batch([specs] * 2, tokens_b[7:20] + TOKENS[10:45], caches)
    for h, fa, fb in zip(hiddens, FULL_HIDDEN, full_b, strict=True):
        torch.testing.assert_close(h[:13], fb[7:20], atol=ATOL, rtol=0)
        torch.testing.assert_close(h[13:], fa[10:45], atol=ATOL, rtol=0)
    assert_kv_equal(caches, [ta] * 2, FULL_CACHES, FULL_TABLE, len(TOKENS))
    assert_kv_equal(caches, [tb] * 2, caches_b_ref, table_b_ref, len(tokens_b))
    assert ChunkBatch(tuple(specs)).last_token_rows().tolist() == [12, 25, 47]


@pytest.mark.parametrize("reused", [18, 16])  # 18: partial block copied; 16: full blocks only
def test_prefix_reuse_with_copy_on_write(reused):
    """A computes 18 tokens; B shares A's first ``reused`` tokens and computes the rest."""
    caches = new_caches()
    table_a = (5, 9, 2, 7, 30)  # 18 tokens: 4 full blocks + 2 tokens in block 30
    run_batch([[ChunkSpec(0, 18, table_a)]] * 2, TOKENS[:18], caches)
    tokens_b = TOKENS[:18] + TOKENS[::-1][:14]  # diverges at 18, 32 tokens
    full_b, ref_caches, ref_table = full_forward(tokens_b)
    shared = reused // BLOCK
    table_b = table_a[:shared] + (11, 12, 13, 14)[: 8 - shared]
    if reused % BLOCK:
        for kv in caches:
            kv.copy_block(table_a[shared], table_b[shared])
    hiddens = run_batch([[ChunkSpec(reused, 32 - reused, table_b)]] * 2, tokens_b[reused:], caches)
    for h, full in zip(hiddens, full_b, strict=True):
        torch.testing.assert_close(h, full[reused:], atol=ATOL, rtol=0)
    logits = STAGES[-1].compute_logits(hiddens[-1][-1:])[0]
    torch.testing.assert_close(
        logits, reference_forward(CONFIG, WEIGHTS, tokens_b)[0], atol=1e-4, rtol=0
    )
    assert_kv_equal(caches, [table_b] * 2, ref_caches, ref_table, 32)
    assert_kv_equal(caches, [table_a] * 2, FULL_CACHES, FULL_TABLE, 18)  # A untouched


def test_copy_block_copies_every_local_layer():
    kv = PagedKVCache.for_model(CONFIG, LayerRange(1, 3), 4, BLOCK)
    for t in kv.tensors:
        t[1].normal_()
    kv.copy_block(1, 3)
    assert all(torch.equal(t[3], t[1]) for t in kv.tensors)
    assert all(t.is_contiguous() and t.shape == (4, 2, BLOCK, 2, 8) for t in kv.tensors)
    with pytest.raises(InvariantError):
        kv.copy_block(0, 4)


def test_broken_calls_raise_invariant_errors():
    caches = new_caches()
    with pytest.raises(InvariantError, match="needs 3 blocks"):
        STAGES[0](torch.tensor(TOKENS[:9]), ChunkBatch((ChunkSpec(0, 9, (0, 1)),)), caches[0])
    with pytest.raises(InvariantError, match="exceeds"):
        STAGES[0](
            torch.tensor(TOKENS[:4]), ChunkBatch((ChunkSpec(0, 4, (NUM_BLOCKS,)),)), caches[0]
        )
    with pytest.raises(InvariantError, match="KV cache holds layers"):
        STAGES[0](torch.tensor(TOKENS[:4]), ChunkBatch((ChunkSpec(0, 4, (0,)),)), caches[1])
    with pytest.raises(InvariantError, match="input shape"):
        STAGES[1](torch.zeros(4, 7), ChunkBatch((ChunkSpec(0, 4, (0,)),)), caches[1])
    with pytest.raises(InvariantError, match="non-last stage"):
        STAGES[0].compute_logits(torch.zeros(1, CONFIG.hidden_size))
    with pytest.raises(InvariantError, match="before load_weights"):
        StageModel(CONFIG, RANGES[0])(
            torch.tensor([1]), ChunkBatch((ChunkSpec(0, 1, (0,)),)), caches[0]
        )
    with pytest.raises(InvariantError):
        ChunkSpec(-1, 3, (0,))
    with pytest.raises(InvariantError):
        ChunkBatch(())
