"""A prompt as admission sees it: the spec the leader sends once, and its per-stage block view."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefill_node.core.hashing import BlockHash, ExtraKeys, hash_block_tokens
from prefill_node.errors import InvalidPromptError


class EmptyPromptError(InvalidPromptError):
    """A prompt needs at least one token."""


@dataclass(frozen=True)
class RequestSpec:
    """A new request, broadcast by the leader to every stage exactly once (picklable).

    ``token_ids`` is the whole prompt; ``extra`` decides what it may share (model, salt).
    """

    request_id: str
    token_ids: tuple[int, ...]
    extra: ExtraKeys

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise EmptyPromptError(f"request {self.request_id!r}: the prompt is empty")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks a prompt occupies on a stage while it runs (the partial last block included)."""
    return -(-num_tokens // block_size)


def max_reusable_blocks(num_tokens: int, block_size: int, *, needs_snapshot: bool = False) -> int:
    """Leading blocks a prompt may take from the cache: every FULL block. The last prompt
    token is still computed (the last stage needs its logits): when every block is reused,
    the last one is taken by copy (``copies_last_block``) and only its last token is
    recomputed. A stage with recurrent-state layers cannot resume mid-block (its state is
    stored only at block boundaries), so there the last token stays outside the reused
    blocks: ``(num_tokens - 1) // block_size``. Every engine and the router use this rule."""
    if needs_snapshot:
        return (num_tokens - 1) // block_size
    return num_tokens // block_size


def reused_tokens(num_tokens: int, block_size: int, reused_blocks: int) -> int:
    """Tokens taken from the cache when ``reused_blocks`` leading blocks are reused: all of
    them, except the prompt's last token, which is always recomputed."""
    return min(reused_blocks * block_size, num_tokens - 1)


def copies_last_block(num_tokens: int, block_size: int, reused_blocks: int) -> bool:
    """True when the reused blocks cover the whole prompt: the last one is then copied into
    a private block (a cached block is never written) to recompute the last token."""
    return reused_blocks * block_size >= num_tokens


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt cut into blocks on one stage: hashes of the full blocks and their tokens.

    Built once per stage when the spec arrives (hashing is deterministic, so every stage
    and the router agree without shipping hashes).
    """

    spec: RequestSpec
    block_size: int
    hashes: tuple[BlockHash, ...] = field(init=False)
    token_blocks: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tokens, b = self.spec.token_ids, self.block_size
        hashes = hash_block_tokens(tokens, b, self.spec.extra)
        object.__setattr__(self, "hashes", hashes)
        blocks = tuple(tokens[i * b : (i + 1) * b] for i in range(len(hashes)))
        object.__setattr__(self, "token_blocks", blocks)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_tokens(self) -> int:
        return self.spec.num_tokens

    @property
    def num_full_blocks(self) -> int:
        return len(self.hashes)

    @property
    def num_blocks(self) -> int:
        return blocks_needed(self.spec.num_tokens, self.block_size)

    def max_reusable_blocks(self, *, needs_snapshot: bool = False) -> int:
        return max_reusable_blocks(
            self.spec.num_tokens, self.block_size, needs_snapshot=needs_snapshot
        )

    def parent_of(self, block_index: int) -> BlockHash | None:
        """Hash of the block before ``block_index`` (None for the first block)."""
        return self.hashes[block_index - 1] if block_index > 0 else None
