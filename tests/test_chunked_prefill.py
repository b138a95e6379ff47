"""Chunked prefill over paged KV == one full forward: any chunk boundaries, shuffled and
per-stage block tables, several chunks per batch, and prefix reuse with copy-on-write.

Dense Qwen3, MoE MiniMax-M2 and GLM-5 (MLA latent cache + DSA indexer; ``family``
fixture): a MoE routes each row on its own and the indexer selects each query's positions on
its own, so chunking must change neither."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.errors import InvariantError
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.reference import reference_forward
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import random_weights
from tests.tiny_models import tiny_glm5, tiny_minimax_m2, tiny_qwen3

BLOCK = 4
NUM_BLOCKS = 40
ATOL = 2e-5

CONFIGS = {
    "qwen3": tiny_qwen3("tiny-chunked", max_position_embeddings=512),
    "minimax-m2": tiny_minimax_m2("tiny-chunked-moe", max_position_embeddings=512),
    "glm-5": tiny_glm5("tiny-chunked-mla", max_position_embeddings=512),
}
CONFIG = CONFIGS["qwen3"]
TOKENS = torch.randint(0, 61, (45,), generator=torch.Generator().manual_seed(2)).tolist()


class Family:
    """One tiny model split into 2 stages, and its one-shot forward over ``TOKENS``."""

    def __init__(self, config) -> None:
        self.config = config
        self.weights = random_weights(config, seed=11)
        self.ranges = split_layers(config.num_layers, 2)
        self.stages = [StageModel.random_init(config, lr, seed=11) for lr in self.ranges]
        self.full_hidden, self.full_caches, self.full_table = self.full_forward(TOKENS)

    def new_caches(self) -> list:
        return [stage_cache(self.config, lr, NUM_BLOCKS, BLOCK) for lr in self.ranges]

    def run_batch(
        self, specs_per_stage: list[list[ChunkSpec]], tokens: list[int], caches
    ) -> list[torch.Tensor]:
        """One forward through every stage (each its own tables); returns each stage's hidden."""
        x: torch.Tensor = torch.tensor(tokens)
        hiddens = []
        for stage, kv, specs in zip(self.stages, caches, specs_per_stage, strict=True):
            x = stage(x, ChunkBatch(tuple(specs)), kv)
            hiddens.append(x)
        return hiddens

    def full_forward(self, tokens: list[int]):
        caches = self.new_caches()
        table = tuple(range(-(-len(tokens) // BLOCK)))
        specs = [[ChunkSpec(0, len(tokens), table)]] * len(self.stages)
        return self.run_batch(specs, tokens, caches), caches, table


FAMILIES = {name: Family(config) for name, config in CONFIGS.items()}
QWEN3 = FAMILIES["qwen3"]
STAGES, RANGES, new_caches = QWEN3.stages, QWEN3.ranges, QWEN3.new_caches


@pytest.fixture(params=list(FAMILIES), scope="module")
def family(request) -> Family:
    return FAMILIES[request.param]


def assert_kv_equal(caches, tables, ref_caches, ref_table, num_tokens):
    """Equal cache contents (K and V, or MLA entries) of ``num_tokens`` positions."""
    for kv, ref, table in zip(caches, ref_caches, tables, strict=True):
        for layer in kv.layer_range:
            got, want = kv.read(layer, table, num_tokens), ref.read(layer, ref_table, num_tokens)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_full_forward_matches_reference(family):
    if family.config.mla is not None:
        pytest.skip("reference_forward has no MLA; test_model_mla.py checks GLM-5 vs transformers")
    logits = family.stages[-1].compute_logits(family.full_hidden[-1][-1:])[0]
    ref_logits, ref_kv = reference_forward(family.config, family.weights, TOKENS)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    for kv in family.full_caches:
        for layer in kv.layer_range:
            k, v = kv.read(layer, family.full_table, len(TOKENS))
            torch.testing.assert_close(k, ref_kv[layer][0], atol=1e-4, rtol=0)
            torch.testing.assert_close(v, ref_kv[layer][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(FAMILIES))
@settings(max_examples=15, deadline=None)
@given(
    cuts=st.sets(st.integers(1, len(TOKENS) - 1), max_size=6),
    perm_seed=st.integers(0, 2**16),
)
def test_arbitrary_chunks_and_shuffled_tables_match_full_forward(name, cuts, perm_seed):
    family = FAMILIES[name]
    bounds = [0, *sorted(cuts), len(TOKENS)]
    g = torch.Generator().manual_seed(perm_seed)
    n = -(-len(TOKENS) // BLOCK)
    tables = [tuple(torch.randperm(NUM_BLOCKS, generator=g)[:n].tolist()) for _ in family.stages]
    caches = family.new_caches()
    for s, e in zip(bounds, bounds[1:], strict=False):
        specs = [[ChunkSpec(s, e - s, t)] for t in tables]
        hiddens = family.run_batch(specs, TOKENS[s:e], caches)
        for h, full in zip(hiddens, family.full_hidden, strict=True):
            torch.testing.assert_close(h, full[s:e], atol=ATOL, rtol=0)
    assert_kv_equal(caches, tables, family.full_caches, family.full_table, len(TOKENS))


def test_several_chunks_in_one_batch(family):
    """Batch 1: A[0,10) and B[0,7). Batch 2: B[7,20), A[10,23) and A[23,45) (A twice)."""
    tokens_b = TOKENS[::-1][:20]
    full_b, caches_b_ref, table_b_ref = family.full_forward(tokens_b)
    ta, tb = tuple(range(0, 12)), tuple(range(39, 33, -1))  # disjoint, B descending
    caches = family.new_caches()
    first = [[ChunkSpec(0, 10, ta), ChunkSpec(0, 7, tb)]] * 2
    family.run_batch(first, TOKENS[:10] + tokens_b[:7], caches)
    specs = [ChunkSpec(7, 13, tb), ChunkSpec(10, 13, ta), ChunkSpec(23, 22, ta)]
    hiddens = family.run_batch([specs] * 2, tokens_b[7:20] + TOKENS[10:45], caches)
    for h, fa, fb in zip(hiddens, family.full_hidden, full_b, strict=True):
        torch.testing.assert_close(h[:13], fb[7:20], atol=ATOL, rtol=0)
        torch.testing.assert_close(h[13:], fa[10:45], atol=ATOL, rtol=0)
    assert_kv_equal(caches, [ta] * 2, family.full_caches, family.full_table, len(TOKENS))
    assert_kv_equal(caches, [tb] * 2, caches_b_ref, table_b_ref, len(tokens_b))
    assert ChunkBatch(tuple(specs)).last_token_rows().tolist() == [12, 25, 47]


@pytest.mark.parametrize("reused", [18, 16])  # 18: partial block copied; 16: full blocks only
def test_prefix_reuse_with_copy_on_write(reused, family):
    """A computes 18 tokens; B shares A's first ``reused`` tokens and computes the rest."""
    caches = family.new_caches()
    table_a = (5, 9, 2, 7, 30)  # 18 tokens: 4 full blocks + 2 tokens in block 30
    family.run_batch([[ChunkSpec(0, 18, table_a)]] * 2, TOKENS[:18], caches)
    tokens_b = TOKENS[:18] + TOKENS[::-1][:14]  # diverges at 18, 32 tokens
    full_b, ref_caches, ref_table = family.full_forward(tokens_b)
    shared = reused // BLOCK
    table_b = table_a[:shared] + (11, 12, 13, 14)[: 8 - shared]
    if reused % BLOCK:
        for kv in caches:
            kv.copy_block(table_a[shared], table_b[shared])
    specs = [[ChunkSpec(reused, 32 - reused, table_b)]] * 2
    hiddens = family.run_batch(specs, tokens_b[reused:], caches)
    for h, full in zip(hiddens, full_b, strict=True):
        torch.testing.assert_close(h, full[reused:], atol=ATOL, rtol=0)
    logits = family.stages[-1].compute_logits(hiddens[-1][-1:])[0]
    if family.config.mla is None:  # independent reference where one exists
        expected = reference_forward(family.config, family.weights, tokens_b)[0]
    else:
        expected = family.stages[-1].compute_logits(full_b[-1][-1:])[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert_kv_equal(caches, [table_b] * 2, ref_caches, ref_table, 32)
    assert_kv_equal(caches, [table_a] * 2, family.full_caches, family.full_table, 18)


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
