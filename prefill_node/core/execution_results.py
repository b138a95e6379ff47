"""What a stage's admission state returns to its executor: block tables and typed failures."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from prefill_node.errors import StageStateError


@dataclass(frozen=True)
class BlockTable:
    """Physical blocks of one request on one stage after materialising chunk [start, end).

    ``block_ids[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``; the table
    covers ``[0, end)``. The first ``num_cached_tokens`` tokens were reused (their blocks
    are shared: never write into them); the chunk's KV goes into the blocks covering
    ``[start, end)``, which this request owns alone.

    ``copy_block`` (source, destination): the prompt was cached whole and its last block
    is reused by copy; before computing this chunk the executor copies the shared cached
    block's KV into the request's private block (the table holds the private one).
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    start: int
    end: int
    copy_block: tuple[int, int] | None = None


class MismatchReason(Enum):
    """Why a stage refuses to run a chunk: its local state does not match the leader's."""

    UNKNOWN_REQUEST = "unknown_request"  # never reserved here, or already finished / aborted
    NOT_COMMITTED = "not_committed"  # reserved but the admission round did not commit it
    WRONG_POSITION = "wrong_position"  # chunk does not start where this stage's state ends
    OUT_OF_RANGE = "out_of_range"  # empty chunk or past the end of the prompt
    INCOMPLETE = "incomplete"  # completion before every token was materialised
    CANNOT_FOLLOW = "cannot_follow"  # (trtllm) this stage's cache cannot take rank 0's decision
    PROMISE_BROKEN = "promise_broken"  # an in-flight prefix's producer never cached it here


@dataclass(frozen=True)
class StageStateMismatch:
    """A chunk (or completion) this stage must not execute; the request has to fail."""

    request_id: str
    stage: int
    reason: MismatchReason
    detail: str

    def to_error(self) -> StageStateError:
        return StageStateError(
            f"stage {self.stage} cannot run request {self.request_id!r}: "
            f"{self.reason.value}: {self.detail}"
        )


@dataclass(frozen=True)
class Completion:
    """A request finished on a stage: ``cached_blocks`` new full blocks became reusable.

    ``block_ids`` is the whole prompt's table. It stays valid only when completed with
    ``keep_pinned``: then the blocks stay referenced (e.g. for a KV pull by decode) until
    ``StageAdmission.unpin``; otherwise the blocks may be evicted and reused at once.
    """

    request_id: str
    block_ids: tuple[int, ...]
    cached_blocks: int
    kept_pinned: bool
