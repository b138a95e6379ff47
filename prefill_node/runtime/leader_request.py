"""LeaderRequest: the leader's record of one request, from submit to its PrefillResult."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from prefill_node.engine.types import (
    PrefillOptions,
    PrefillResult,
    PrefillTimings,
    StageKVManifest,
)
from prefill_node.runtime.messages import RequestOutput


@dataclass
class LeaderRequest:
    """One request as the PipelineEngine tracks it (under the engine lock).

    ``manifests``: the stages' local manifests as the wave reported them. ``output``: set
    when the logits arrived but the answer still waits for the KV hand-off (requests with a
    ``kv_destination``); the future resolves exactly once, by whoever removes the record.
    """

    request_id: str
    token_ids: tuple[int, ...]
    options: PrefillOptions
    future: Future[PrefillResult]
    t_submit: float
    t_admitted: float = 0.0
    admission_s: float = 0.0
    cached_tokens: int = 0
    manifests: dict[int, StageKVManifest] = field(default_factory=dict)
    output: RequestOutput | None = None
    # requests with a KV hand-off: when the last chunk's forward ended on the last stage
    # (``output``'s arrival less the stage's ``WaveResult.held_s``)
    t_last_chunk: float = 0.0

    def result(
        self, out: RequestOutput, now: float, manifests: tuple[StageKVManifest, ...]
    ) -> PrefillResult:
        """The answer: the last position's top logprobs, counts, timings, ``manifests``."""
        timings = PrefillTimings(
            queue_s=self.t_admitted - self.t_submit,
            admission_s=self.admission_s,
            compute_s=now - self.t_admitted,
            total_s=now - self.t_submit,
            handoff_s=now - self.t_last_chunk if self.t_last_chunk else 0.0,
        )
        return PrefillResult(
            request_id=self.request_id,
            first_token_id=out.top_logprobs[0][0],
            top_logprobs=tuple(out.top_logprobs[: self.options.top_logprobs]),
            prompt_tokens=len(self.token_ids),
            cached_tokens=self.cached_tokens,
            computed_tokens=len(self.token_ids) - self.cached_tokens,
            timings=timings,
            stage_manifests=manifests,
        )


def settle_future(fut: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolve ``fut`` once; later attempts (a race with abort or failure) are ignored."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except Exception:  # InvalidStateError: already settled
        pass
