"""Chained block hashing: determinism, chaining, extra keys, wire encoding and bad input."""

import struct

import pytest
import xxhash

from prefill_node.core.hashing import (
    HASH_SEED,
    ExtraKeys,
    InvalidTokenIdsError,
    hash_block,
    hash_block_tokens,
)
from prefill_node.errors import InvalidRequestError

EXTRA = ExtraKeys(model_id="tiny-llama")


def test_chain_equals_iterated_single_block_hashes():
    tokens = list(range(100, 148))  # 3 full blocks of 16
    chain = hash_block_tokens(tokens, 16, EXTRA)
    parent = None
    expected = []
    for i in range(3):
        parent = hash_block(parent, tokens[16 * i : 16 * (i + 1)], EXTRA)
        expected.append(parent)
    assert chain == tuple(expected)
    assert len(set(chain)) == 3


def test_partial_trailing_block_is_not_hashed_and_chain_continues_from_parent():
    tokens = list(range(40))  # 2 full blocks of 16 + 8 tokens
    full = hash_block_tokens(tokens, 16, EXTRA)
    assert len(full) == 2
    head = hash_block_tokens(tokens[:16], 16, EXTRA)
    tail = hash_block_tokens(tokens[16:], 16, EXTRA, parent=head[-1])
    assert head + tail == full


def test_same_block_tokens_after_different_prefix_hash_differently():
    a = hash_block_tokens([1] * 16 + [7] * 16, 16, EXTRA)
    b = hash_block_tokens([2] * 16 + [7] * 16, 16, EXTRA)
    assert a[1] != b[1]


def test_extra_keys_separate_tenants_models_and_adapters():
    tokens = list(range(16))
    variants = [
        ExtraKeys("m"),
        ExtraKeys("m", cache_salt="tenant-a"),
        ExtraKeys("m", cache_salt="tenant-b"),
        ExtraKeys("m2"),
        ExtraKeys("m", adapter="lora-1"),
        ExtraKeys("ab"),
        ExtraKeys("a", cache_salt="b"),
        ExtraKeys("m", cache_salt=""),
    ]
    hashes = {hash_block(None, tokens, e) for e in variants}
    assert len(hashes) == len(variants)
    assert hash_block(None, tokens, ExtraKeys("m", "s")) == hash_block(
        None, tokens, ExtraKeys("m", "s")
    )


def test_wire_encoding_is_little_endian_int64_with_fixed_seed():
    """The router and other pipelines recompute hashes: the encoding is a contract."""
    tokens = [0, 1, 2**40, 5]
    h0 = hash_block(None, tokens, EXTRA)
    data = b"\x00ROOT\x00\x00\x00" + EXTRA.digest + struct.pack("<4q", *tokens)
    assert h0 == xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)
    h1 = hash_block(h0, tokens, EXTRA)
    data1 = struct.pack("<Q", h0) + EXTRA.digest + struct.pack("<4q", *tokens)
    assert h1 == xxhash.xxh3_64_intdigest(data1, seed=HASH_SEED)


@pytest.mark.parametrize("tokens", [[1, -1, 2, 3], [1, 2**63], [1, "x"]])
def test_bad_token_ids_raise_typed_error(tokens):
    with pytest.raises(InvalidTokenIdsError):
        hash_block_tokens(tokens, 2, EXTRA)


def test_bad_block_size_raises_typed_error():
    with pytest.raises(InvalidRequestError, match="block_size"):
        hash_block_tokens([1, 2], 0, EXTRA)
