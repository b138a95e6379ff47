"""Prefix index: counters follow attach/detach; probe + binary search finds the cached prefix."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_node.core.block_pool import BlockPool
from prefill_node.core.hashing import BlockHash, ExtraKeys, hash_block_tokens
from prefill_node.core.prefix_index import PrefixIndex
from prefill_node.errors import InvariantError


def hashes(n):
    return [BlockHash(1000 + i) for i in range(n)]


def test_counters_follow_attach_and_detach():
    idx = PrefixIndex()
    h = BlockHash(7)
    assert idx.attach(h) is True
    assert idx.attach(h) is False
    assert idx.count(h) == 2
    assert idx.detach(h) is False
    assert idx.detach(h) is True
    assert h not in idx
    with pytest.raises(InvariantError):
        idx.detach(h)


@pytest.mark.parametrize("present", [0, 1, 2, 3, 5, 8, 13, 31, 32, 33, 64])
def test_longest_prefix_exact(present):
    chain = hashes(64)
    idx = PrefixIndex()
    for h in chain[:present]:
        idx.attach(h)
    assert idx.longest_prefix(chain) == present
    assert idx.longest_prefix(chain, limit=10) == min(present, 10)
    assert idx.longest_prefix(chain[:present]) == present


def test_probe_cost_is_logarithmic():
    chain = hashes(4096)
    idx = PrefixIndex()
    for h in chain[:3000]:
        idx.attach(h)
    probed = []

    class Spy(list):
        def __getitem__(self, i):
            probed.append(i)
            return list.__getitem__(self, i)

    assert idx.longest_prefix(Spy(chain)) == 3000
    assert len(probed) <= 2 * 12 + 2


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(0, 220))
def test_longest_prefix_matches_linear_scan(present, limit):
    chain = hashes(200)
    idx = PrefixIndex()
    for h in chain[:present]:
        idx.attach(h)
    assert idx.longest_prefix(chain, limit) == min(present, limit)


def test_pool_keeps_the_index_exact_under_lazy_eviction():
    pool = BlockPool(4, 4)
    extra = ExtraKeys("m")
    tokens = list(range(16))
    chain = hash_block_tokens(tokens, 4, extra)
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, chain, [tuple(tokens[i : i + 4]) for i in range(0, 16, 4)], extra)
    pool.free(blocks)
    assert pool.index.longest_prefix(chain) == 4
    pool.allocate(1)  # evicts the chain's tail block
    assert pool.index.longest_prefix(chain) == 3
    pool.allocate(2)
    assert pool.index.longest_prefix(chain) == 1
    pool.check_integrity()
