"""Paged attention over chunk batches: the SPLIT path (context part + causal chunk part,
merged by log-sum-exp) and the MASKED reference path both equal attention computed
directly in float64 from the whole sequences, in fp32 and in bf16, for GQA / MQA / MHA, odd
lengths and block sizes, and batches mixing chunks with and without cached context
(including two chunks of one sequence in one batch)."""

from __future__ import annotations

import pytest
import torch

from prefill_node.errors import InvariantError
from prefill_node.model.attention import AttentionPath, AttentionPlan, paged_attention
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange

LAYER = 2

# (sequence length, chunks as (start, length) in batch order): sequence 0 has 13 cached
# positions; sequence 1 none; sequence 2 two chunks in the same batch; sequence 3 one query
# after 37 cached positions.
SEQUENCES = (
    (30, ((13, 17),)),
    (9, ((0, 9),)),
    (20, ((0, 11), (11, 9))),
    (38, ((37, 1),)),
)


class Case:
    """Random whole-sequence q/k/v, the cached context written into a paged cache, and the
    batch's rows; ``expected`` is float64 causal attention over each whole sequence."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block: int, dtype, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.dtype = heads, kv_heads, dtype
        self.seqs = [
            tuple(torch.randn(n, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
            for n, _ in SEQUENCES
        ]
        blocks_per_seq = [-(-n // block) for n, _ in SEQUENCES]
        ids = torch.randperm(sum(blocks_per_seq) + 3, generator=g).tolist()
        self.tables = []
        for n in blocks_per_seq:
            self.tables.append(tuple(ids[:n]))
            ids = ids[n:]
        num_blocks = sum(blocks_per_seq) + 3
        self.kv_args = (LayerRange(0, LAYER + 1), num_blocks, block, kv_heads, head_dim, dtype)
        specs, rows = [], []
        self.reads_cached_context = []  # per chunk: attends to positions cached before the call
        for qkv, table, (_, chunks) in zip(self.seqs, self.tables, SEQUENCES, strict=True):
            for start, length in chunks:
                specs.append(ChunkSpec(start, length, table))
                rows.append([t[start : start + length] for t in qkv])
                self.reads_cached_context.append(start > 0 and start == chunks[0][0])
        self.batch = ChunkBatch(tuple(specs))
        self.q, self.k, self.v = (torch.cat([r[i] for r in rows]).to(dtype) for i in range(3))

    def cache(self) -> PagedKVCache:
        """A cache holding each sequence's positions before its first chunk of the batch."""
        kv = PagedKVCache(*self.kv_args)
        for (_, k, v), table, (_, chunks) in zip(self.seqs, self.tables, SEQUENCES, strict=True):
            if chunks[0][0]:
                kv.write(LAYER, table, 0, k[: chunks[0][0]], v[: chunks[0][0]])
        return kv

    def run(self, path: AttentionPath) -> torch.Tensor:
        kv = self.cache()
        plan = AttentionPlan.build(self.batch, kv, self.dtype, path)
        out = paged_attention(self.q, self.k, self.v, plan, kv, LAYER)
        assert out.dtype == self.dtype
        return out.view(-1, self.heads, self.q.shape[-1]).double()

    def expected(self) -> torch.Tensor:
        """Float64 attention of every batch row over its sequence's positions [0, pos], from
        the inputs as rounded to ``dtype`` (what both paths see)."""
        outs = []
        for (q, k, v), (_, chunks) in zip(self.seqs, SEQUENCES, strict=True):
            q, k, v = (t.to(self.dtype).double() for t in (q, k, v))
            group = self.heads // self.kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
            n = q.shape[0]
            scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
            full = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
            outs += [full[start : start + length] for start, length in chunks]
        return torch.cat(outs)


SHAPES = [(6, 2, 16, 4), (8, 1, 32, 7), (4, 4, 8, 5), (9, 3, 64, 16)]


@pytest.mark.parametrize("path", list(AttentionPath))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block", SHAPES)
def test_fp32_paths_equal_direct_attention(path, heads, kv_heads, head_dim, block):
    case = Case(heads, kv_heads, head_dim, block, torch.float32, seed=heads * 100 + head_dim)
    torch.testing.assert_close(case.run(path), case.expected(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block", SHAPES)
def test_fp32_split_equals_masked(heads, kv_heads, head_dim, block):
    case = Case(heads, kv_heads, head_dim, block, torch.float32, seed=7)
    split, masked = case.run(AttentionPath.SPLIT), case.run(AttentionPath.MASKED)
    torch.testing.assert_close(split, masked, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block", SHAPES)
def test_bf16_split_within_bf16_of_fp64_and_no_worse_than_masked(heads, kv_heads, head_dim, block):
    case = Case(heads, kv_heads, head_dim, block, torch.bfloat16, seed=heads + head_dim)
    expected = case.expected()
    split, masked = case.run(AttentionPath.SPLIT), case.run(AttentionPath.MASKED)
    torch.testing.assert_close(split, expected, atol=2e-2, rtol=1.6e-2)
    # the merge rounds two partial outputs to bf16 before combining them: its error stays
    # of the order of the single-pass kernel's (a few bf16 ulps of values of size ~1)
    split_err = (split - expected).abs().max().item()
    masked_err = (masked - expected).abs().max().item()
    assert split_err <= 2 * masked_err + 8e-3, (split_err, masked_err)


def test_context_changes_the_output():
    """Guard against a merge that ignores a part: dropping the cached context (a cache
    without it) changes the rows of chunks that have context, and only those."""
    case = Case(6, 2, 16, 4, torch.float32, seed=3)
    with_ctx = case.run(AttentionPath.SPLIT)
    kv = PagedKVCache(*case.kv_args)  # context never written: zeros
    plan = AttentionPlan.build(case.batch, kv, torch.float32, AttentionPath.SPLIT)
    without = paged_attention(case.q, case.k, case.v, plan, kv, LAYER).view_as(with_ctx)
    diff = (with_ctx - without.double()).abs().amax(dim=(1, 2))
    offsets = case.batch.row_offsets
    # sequence 2's second chunk reads its first chunk's K/V, written by this same call
    assert case.reads_cached_context == [True, False, False, False, True]
    for i, reads in enumerate(case.reads_cached_context):
        rows = diff[offsets[i] : offsets[i + 1]]
        assert (rows > 1e-3).all() if reads else (rows < 1e-6).all(), (i, rows)


def test_split_is_the_cpu_default_and_builds_no_masks():
    case = Case(6, 2, 16, 4, torch.float32, seed=5)
    kv = case.cache()
    assert AttentionPath.default_for(kv.device) is AttentionPath.SPLIT
    plan = AttentionPlan.build(case.batch, kv, torch.float32)
    assert plan.path is AttentionPath.SPLIT
    assert all(cp.mask is None for cp in plan.chunks)
    masked = AttentionPlan.build(case.batch, kv, torch.float32, AttentionPath.MASKED)
    assert [cp.mask is not None for cp in masked.chunks] == [c.start > 0 for c in case.batch.chunks]


def test_split_off_the_cpu_is_refused():
    kv = PagedKVCache(LayerRange(0, 1), 4, 4, 2, 8, torch.float32, device="meta")
    batch = ChunkBatch((ChunkSpec(0, 3, (0,)),))
    assert AttentionPath.default_for(kv.device) is AttentionPath.MASKED
    with pytest.raises(InvariantError, match="CPU only"):
        AttentionPlan.build(batch, kv, torch.float32, AttentionPath.SPLIT)


def test_mla_caches_get_masked_plans_and_refuse_split():
    """MLA layers attend through their own SDPA call with the plan's masks: an MLA cache's
    plan is MASKED by default (masks built once per forward), and SPLIT, which builds none, is
    refused for it."""
    from prefill_node.model.latent_cache import PagedLatentCache
    from tests.tiny_models import tiny_kimi

    kv = PagedLatentCache(tiny_kimi().mla, LayerRange(0, 1), 4, 4)
    batch = ChunkBatch((ChunkSpec(2, 3, (0, 1)),))
    plan = AttentionPlan.build(batch, kv, torch.float32)
    assert plan.path is AttentionPath.MASKED and plan.chunks[0].mask is not None
    with pytest.raises(InvariantError, match="GQA caches"):
        AttentionPlan.build(batch, kv, torch.float32, AttentionPath.SPLIT)


def _shared_prefix_wave(dtype: torch.dtype, order: str):
    """Sequences sharing a 12-position prefix (3 blocks of 4), written once: A, B, C read it
    from the same blocks, E from a copy in other blocks; D has no context. ``order`` is the
    batch's chunks in row order. Returns the cache, batch, q/k/v rows and the float64
    attention of each row over its whole sequence."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, d, block, prefix = 6, 2, 16, 4, 12
    lengths = {"A": 5, "B": 3, "C": 1, "D": 6, "E": 2}
    pre = [torch.randn(prefix, h, d, generator=g) for h in (heads, kv_heads, kv_heads)]
    kv = PagedKVCache(LayerRange(0, LAYER + 1), 20, block, kv_heads, d, dtype)
    kv.write(LAYER, (0, 1, 2), 0, pre[1], pre[2])
    kv.write(LAYER, (3, 4, 5), 0, pre[1], pre[2])  # E's copy of the prefix
    own_blocks = {"A": (6, 7), "B": (8,), "C": (9,), "E": (10,), "D": (11, 12)}
    specs, rows, expected = [], [], []
    for name in order:
        n = lengths[name]
        new = [torch.randn(n, h, d, generator=g) for h in (heads, kv_heads, kv_heads)]
        start = 0 if name == "D" else prefix
        table = own_blocks[name] if name == "D" else (3, 4, 5) if name == "E" else (0, 1, 2)
        specs.append(ChunkSpec(start, n, table + ((own_blocks[name]) if start else ())))
        rows.append(new)
        whole = [torch.cat((p, x)) if start else x for p, x in zip(pre, new, strict=True)]
        q, k, v = (t.to(dtype).double() for t in whole)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        scores = scores.masked_fill(torch.ones(len(q), len(q)).triu(1).bool(), float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)[start:])
    q, k, v = (torch.cat([r[i] for r in rows]).to(dtype) for i in range(3))
    return kv, ChunkBatch(tuple(specs)), (q, k, v), torch.cat(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "order,runs",
    [("ABC", [(0, 9, 3)]), ("ABDCE", [(0, 8, 2), (8, 14, 1), (14, 15, 1), (15, 17, 1)])],
)
def test_chunks_sharing_a_context_attend_to_it_in_one_run(dtype, order, runs):
    """SPLIT groups consecutive chunks whose context is the same blocks up to the same start
    (one gather, one kernel call over all their queries); a copy of the context in other
    blocks, or a chunk without context in between, starts a new run. Every row still equals
    attention over its own whole sequence, as MASKED computes it."""
    kv, batch, (q, k, v), expected = _shared_prefix_wave(dtype, order)
    plan = AttentionPlan.build(batch, kv, dtype, AttentionPath.SPLIT)
    assert [(r.row_start, r.row_end, len(r.chunks)) for r in plan.runs] == runs
    split = paged_attention(q, k, v, plan, kv, LAYER).view_as(expected).double()
    masked_plan = AttentionPlan.build(batch, kv, dtype, AttentionPath.MASKED)
    masked = paged_attention(q, k, v, masked_plan, kv, LAYER).view_as(expected).double()
    if dtype is torch.float32:
        torch.testing.assert_close(split, expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(split, masked, atol=1e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(split, expected, atol=2e-2, rtol=1.6e-2)
        split_err = (split - expected).abs().max().item()
        masked_err = (masked - expected).abs().max().item()
        assert split_err <= 2 * masked_err + 8e-3, (split_err, masked_err)
