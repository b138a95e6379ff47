"""One pipeline stage's executor: its StageModel, its paged KV memory and its block pool.

A StageExecutor is everything ONE stage process owns; the in-process LocalEngine holds P of
them, the multi-process runtime one per process. It knows nothing of other stages: the caller
negotiates the common prefix across stages and tells each stage what to pin and compute.

Request life cycle on a stage (the caller drives it, in this order):

1. ``local_hit_blocks(hashes)``: the hint (prefix index), no pins.
2. ``pin_prefix(...)``: authoritative, collision-guarded; pins the leading blocks it confirms
   (maybe fewer than asked). The caller owns those references.
3. ``materialise(...)``: allocates the suffix blocks and returns a ``StageSequence`` that owns
   ALL its block references (the pinned prefix included), or None when the pool is short (the
   pins stay with the caller). When the reused prefix covers the whole prompt, the last token
   must still be computed for the logits: its shared block is copied into a private block
   (copy-on-write) and the shared one unpinned, so a cached block is never written.
4. ``execute(chunks, inputs)``: chunks must continue each sequence where it stopped.
5. ``finish(seq)``: makes the newly computed full blocks findable, returns the KV manifest and
   drops the sequence's references (the KV stays cached until evicted). ``release(seq)``
   drops them without caching (abort / failure). Exactly one of the two, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prefill_node.core.block import KVBlock
from prefill_node.core.block_pool import BlockPool
from prefill_node.core.hashing import BlockHash, ExtraKeys
from prefill_node.core.request import copies_last_block, reused_tokens
from prefill_node.engine.types import StageKVManifest, StageLoad
from prefill_node.errors import InvariantError
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.stage_model import StageModel


@dataclass
class StageSequence:
    """One request's state on one stage. ``blocks`` is its block table (owned references)."""

    request_id: str
    token_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]  # chained hashes of the prompt's full blocks
    extra: ExtraKeys
    blocks: list[KVBlock]
    num_cached_tokens: int  # positions [0, cached) were reused, not computed
    num_computed_tokens: int = field(init=False)  # positions [0, computed) hold KV now

    def __post_init__(self) -> None:
        self.num_computed_tokens = self.num_cached_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.blocks)

    @property
    def is_complete(self) -> bool:
        return self.num_computed_tokens == self.num_tokens


@dataclass(frozen=True)
class ChunkWork:
    """Compute positions [start, start + length) of ``seq`` in one forward."""

    seq: StageSequence
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class StageStep:
    """Output of one forward: the residual stream for the next stage and, on the last stage,
    the fp32 logits [k, vocab] of the last prompt token of each chunk in ``completed``."""

    hidden: torch.Tensor
    completed: tuple[int, ...]  # indices into the chunk list that finished their prompt
    logits: torch.Tensor | None


class StageExecutor:
    """Stage ``stage`` of a pipeline. Not thread-safe: one caller (the stage loop) at a time."""

    def __init__(
        self,
        stage: int,
        model: StageModel,
        num_blocks: int,
        block_size: int,
        *,
        events: bool = False,
    ) -> None:
        self.stage = stage
        self.model = model
        self.kv = PagedKVCache.for_model(
            model.config, model.layer_range, num_blocks, block_size, model.dtype, model.device
        )
        self.pool = BlockPool(num_blocks, block_size, enable_events=events)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` occupies."""
        return -(-num_tokens // self.block_size)

    def suffix_blocks(self, num_tokens: int, prefix_blocks: int) -> int:
        """Fresh blocks ``materialise`` needs after a pinned prefix of ``prefix_blocks``
        (one more when the prefix covers the whole prompt: the copy-on-write last block)."""
        covers_all = copies_last_block(num_tokens, self.block_size, prefix_blocks)
        return self.blocks_for(num_tokens) - prefix_blocks + covers_all

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` fits this stage's cache when nothing else runs."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    # ---- cache core ----------------------------------------------------------------

    def local_hit_blocks(self, hashes: Sequence[BlockHash], limit: int | None = None) -> int:
        """Hint: leading blocks of ``hashes[:limit]`` probably resident here (no pins)."""
        return self.pool.index.longest_prefix(hashes, limit)

    def pin_prefix(
        self,
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        extra: ExtraKeys,
        num_blocks: int,
    ) -> list[KVBlock]:
        """Pin up to ``num_blocks`` leading blocks, stopping at the first one not resident
        (or failing the collision guard). The caller owns one reference per returned block."""
        pinned: list[KVBlock] = []
        parent: BlockHash | None = None
        bs = self.block_size
        for i, block_hash in enumerate(hashes[:num_blocks]):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(block_hash, parent, tokens, extra)
            if block is None:
                break
            self.pool.touch([block])
            pinned.append(block)
            parent = block_hash
        return pinned

    def unpin(self, blocks: Sequence[KVBlock]) -> None:
        """Drop references taken by ``pin_prefix`` (a chain in prompt order)."""
        self.pool.free(blocks)

    def materialise(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash],
        extra: ExtraKeys,
        prefix: list[KVBlock],
        reserved: list[KVBlock] | None = None,
    ) -> StageSequence | None:
        """Allocate the blocks after the pinned ``prefix`` and build the sequence.

        Reuses ``reused_tokens(num_tokens, block_size, len(prefix))`` tokens (the core's one
        reuse rule, ``core/request.py``). ``reserved``: blocks
        the caller already owns for the suffix (e.g. an escrow's ``take_claimed``), exactly
        ``suffix_blocks(...)`` of them; without it they are allocated here. On None (pool
        short) nothing changed and the caller still owns ``prefix``; otherwise the sequence
        owns ``prefix`` and the suffix blocks.
        """
        n = len(token_ids)
        cached = reused_tokens(n, self.block_size, len(prefix))
        copy_last = copies_last_block(n, self.block_size, len(prefix))
        need = self.suffix_blocks(n, len(prefix))
        if reserved is not None and len(reserved) != need:
            raise InvariantError(f"{len(reserved)} reserved blocks for a suffix of {need}")
        fresh = self.pool.allocate(need) if reserved is None else list(reserved)
        if fresh is None:
            return None
        blocks = list(prefix)
        if copy_last:
            shared = blocks.pop()
            self.kv.copy_block(shared.block_id, fresh[0].block_id)
            self.pool.free([shared])
        blocks.extend(fresh)
        return StageSequence(request_id, tuple(token_ids), tuple(hashes), extra, blocks, cached)

    def finish(self, seq: StageSequence) -> StageKVManifest:
        """Cache the sequence's newly computed full blocks, then drop its references."""
        if not seq.is_complete:
            raise InvariantError(
                f"finish of {seq.request_id!r} on stage {self.stage} at "
                f"{seq.num_computed_tokens}/{seq.num_tokens} tokens"
            )
        first = self.blocks_for(seq.num_cached_tokens)  # first block this request computed
        last = seq.num_tokens // self.block_size  # full blocks end here
        if last > first:
            bs = self.block_size
            self.pool.cache_blocks(
                seq.blocks[first:last],
                seq.block_hashes[first:last],
                [seq.token_ids[i * bs : (i + 1) * bs] for i in range(first, last)],
                seq.extra,
                parent_hash=seq.block_hashes[first - 1] if first else None,
            )
        manifest = self.manifest(seq)
        self.release(seq)
        return manifest

    def release(self, seq: StageSequence) -> None:
        """Drop every reference ``seq`` holds (after ``finish``'s caching, or on failure)."""
        blocks, seq.blocks = seq.blocks, []
        self.pool.free(blocks)

    def manifest(self, seq: StageSequence) -> StageKVManifest:
        """Where this stage holds ``seq``'s KV: its layers' blocks in prompt order."""
        kv = self.kv
        return StageKVManifest(
            stage=self.stage,
            layer_start=kv.layer_range.start,
            layer_end=kv.layer_range.end,
            block_ids=seq.block_table,
            block_size=self.block_size,
            num_tokens=seq.num_tokens,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            dtype=str(kv.dtype).removeprefix("torch."),
        )

    def load(self) -> StageLoad:
        stats = self.pool.stats()
        return StageLoad(self.stage, stats.free, stats.cached, stats.in_use, stats.total)

    def check_integrity(self) -> None:
        self.pool.check_integrity()

    # ---- execution -----------------------------------------------------------------

    def execute(self, chunks: Sequence[ChunkWork], inputs: torch.Tensor) -> StageStep:
        """Run this stage's layers on ``chunks`` (rows concatenated in chunk order).

        ``inputs``: token ids [T] on the first stage, else the previous stage's hidden [T, H].
        Each chunk must start where its sequence stopped (InvariantError otherwise: a stage
        never computes on a cache state that does not match the schedule).
        """
        for work in chunks:
            seq = work.seq
            if work.start != seq.num_computed_tokens or work.end > seq.num_tokens:
                raise InvariantError(
                    f"stage {self.stage}: chunk [{work.start}, {work.end}) of {seq.request_id!r} "
                    f"does not continue its KV at {seq.num_computed_tokens}/{seq.num_tokens}"
                )
        batch = ChunkBatch(tuple(ChunkSpec(w.start, w.length, w.seq.block_table) for w in chunks))
        hidden = self.model(inputs.to(self.model.device), batch, self.kv)
        for work in chunks:
            work.seq.num_computed_tokens = work.end
        completed = tuple(i for i, w in enumerate(chunks) if w.end == w.seq.num_tokens)
        logits = None
        if self.is_last and completed:
            rows = batch.last_token_rows(self.model.device)[list(completed)]
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        return StageStep(hidden, completed, logits)
