"""Stage slicing: contiguous layer ranges, even and weighted splits, typed errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_node.errors import InvalidPartitionError, InvalidRequestError
from prefill_node.model.partition import LayerRange, split_layers


def test_even_split_gives_extra_layers_to_early_stages():
    assert split_layers(30, 4) == [
        LayerRange(0, 8),
        LayerRange(8, 16),
        LayerRange(16, 23),
        LayerRange(23, 30),
    ]
    assert split_layers(3, 3) == [LayerRange(0, 1), LayerRange(1, 2), LayerRange(2, 3)]


def test_weighted_split():
    assert split_layers(30, 3, [1, 2, 3]) == [
        LayerRange(0, 5),
        LayerRange(5, 15),
        LayerRange(15, 30),
    ]
    # a tiny weight still gets one layer
    assert split_layers(4, 3, [100, 0.01, 100]) == [
        LayerRange(0, 2),
        LayerRange(2, 3),
        LayerRange(3, 4),
    ]


@given(
    st.integers(1, 64).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.floats(0.01, 10), min_size=1, max_size=n))
    )
)
def test_any_split_is_contiguous_and_non_empty(args):
    n, weights = args
    for ranges in (split_layers(n, len(weights)), split_layers(n, len(weights), weights)):
        assert ranges[0].start == 0 and ranges[-1].end == n
        assert all(a.end == b.start for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(len(r) >= 1 for r in ranges)


def test_layer_range_protocol_and_errors():
    r = LayerRange(2, 5)
    assert list(r) == [2, 3, 4] and len(r) == 3 and 4 in r and 5 not in r and r.local(3) == 1
    assert not r.is_first() and r.is_last(5)
    with pytest.raises(InvalidPartitionError):
        LayerRange(3, 3)
    with pytest.raises(InvalidPartitionError, match="cannot split 2 layers into 3"):
        split_layers(2, 3)
    with pytest.raises(InvalidPartitionError, match="one per stage"):
        split_layers(4, 2, [1.0])
    with pytest.raises(InvalidPartitionError, match="> 0"):
        split_layers(4, 2, [1.0, 0.0])
    assert issubclass(InvalidPartitionError, InvalidRequestError)
