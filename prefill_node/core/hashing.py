"""Chained block hashing: the identity of a full KV block together with everything before it.

``H_i = xxh3_64(parent H_{i-1} | digest(extra keys) | token ids of block i, seed=HASH_SEED)``.

Two distinct notions, two types:

- ``ExtraKeys`` is per REQUEST: what besides the tokens decides whether a KV block can be
  shared (model identity, per-tenant cache salt, adapter). Requests with different extra
  keys never share a block.
- ``BlockHash`` is per BLOCK: the chained hash of one full block of ``block_size`` tokens,
  covering its whole prefix. Equal hashes mean "same prefix" up to a 64-bit collision; the
  block pool guards against collisions by comparing parent hash, extra keys and token ids
  on every hit (``BlockPool.lookup``).

The encoding is fixed (little-endian int64 token ids, fixed seed), so every stage, every
pipeline and the router compute the same hashes for the same prompt on any machine.
Only FULL blocks are hashed; a trailing partial block is never shared.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import xxhash

from prefill_node.errors import InvalidRequestError

BlockHash = NewType("BlockHash", int)
"""Chained hash of one full block (unsigned 64-bit), covering the block and its prefix."""

HASH_SEED = 0x5741_5645_5050  # "WAVEPP"; changing it invalidates every published hash
_ROOT_PARENT = b"\x00ROOT\x00\x00\x00"  # encodes "no parent" (first block) in 8 bytes
_LITTLE_ENDIAN = sys.byteorder == "little"


class InvalidTokenIdsError(InvalidRequestError):
    """Token ids must be non-negative integers below 2**63."""


@dataclass(frozen=True)
class ExtraKeys:
    """Request-level cache identity; requests share blocks only when these are equal.

    ``model_id`` names the weights (and anything else that changes the KV, e.g. dtype);
    ``cache_salt`` isolates tenants; ``adapter`` names a LoRA adapter (None = base model).
    """

    model_id: str
    cache_salt: str | None = None
    adapter: str | None = None
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = xxhash.xxh3_64(seed=HASH_SEED)
        for part in (self.model_id, self.cache_salt, self.adapter):
            # Length-prefixed so ("ab", None) and ("a", "b") never encode the same.
            data = b"" if part is None else part.encode("utf-8")
            h.update((len(data) + (0 if part is None else 1)).to_bytes(8, "little"))
            h.update(data)
        object.__setattr__(self, "digest", h.digest())


def model_cache_id(model_name: str, dtype: str) -> str:
    """``ExtraKeys.model_id`` of a model served in ``dtype`` (``"float32"`` or ``torch.float32``):
    the one spelling every engine and the router use, so their block hashes agree."""
    return f"{model_name or 'model'}|{str(dtype).removeprefix('torch.')}"


def model_cache_name(model_id: str) -> str:
    """The model name inside a ``model_cache_id`` (what a router compares to its model)."""
    return model_id.rpartition("|")[0] or model_id


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        arr = array("q", token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidTokenIdsError(f"token ids must be integers in [0, 2**63): {exc}") from None
    if arr and min(arr) < 0:
        raise InvalidTokenIdsError("token ids must be non-negative")
    if not _LITTLE_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    prefix = _ROOT_PARENT if parent is None else parent.to_bytes(8, "little")
    data = prefix + extra.digest + _token_bytes(token_ids)
    return BlockHash(xxhash.xxh3_64_intdigest(data, seed=HASH_SEED))


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    extra: ExtraKeys,
    parent: BlockHash | None = None,
) -> tuple[BlockHash, ...]:
    """Chained hashes of every FULL block of ``token_ids`` (a trailing partial block is skipped).

    ``parent`` continues an existing chain (the hash of the block just before
    ``token_ids[0]``); None starts a new prompt. Raises InvalidTokenIdsError on bad ids.
    """
    if block_size <= 0:
        raise InvalidRequestError(f"block_size must be positive, got {block_size}")
    raw = _token_bytes(token_ids)
    stride = 8 * block_size
    hashes: list[BlockHash] = []
    digest = extra.digest
    prev = _ROOT_PARENT if parent is None else parent.to_bytes(8, "little")
    for start in range(0, len(token_ids) // block_size * stride, stride):
        value = xxhash.xxh3_64_intdigest(prev + digest + raw[start : start + stride], HASH_SEED)
        hashes.append(BlockHash(value))
        prev = value.to_bytes(8, "little")
    return tuple(hashes)
