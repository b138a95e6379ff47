"""The one sans-IO leader: the admission coordinator and the wave scheduler, glued once.

Every driver of a pipeline's schedule goes through ``LeaderCore``: the runtime's ``Leader``
(threads, planes, the wire header), both engines through it, and the simulator (simulated
time, direct calls to the stages). What it owns:

- admission verdicts -> the scheduler: an admitted request starts at its cached length,
  a promised one behind its producer's chunk (``WaveScheduler``); the coordinator's cuts
  (where a waiter's prefix ends inside a producer's prompt) become chunk ends;
- a returned wave -> the coordinator: finished requests leave its in-flight prefixes,
  dropped ones (aborted or failed, nothing left in flight) are forgotten on every stage,
  the other chunks' full blocks release the requests waiting for them;
- a deferred abort: an admitted request's stage-side cleanup waits until none of its
  chunks is in flight, so a stage never frees blocks a forward is writing;
- when a round is worth running (``has_round_work``): only after something changed (a new
  request, a completion, an abort, released blocks, or a round that admitted someone), so
  requests waiting for capacity do not spin the rounds;
- each request's ``options`` (what its chunks carry to the stages; opaque here), given
  once at ``enqueue`` and dropped when the request leaves or is aborted; ``is_first``
  tells the chunk that carries what the stages keep;
- under a rank-0-decides policy (``follow_waves``), what the stages after the first learn
  from the waves instead of from rounds: each admitted prompt with its first chunk and each
  stage-side cleanup (``take_follow``).

Lengths: the coordinator and the stages count token ids; the scheduler and every caller of
this class count tokens. ``token_scale`` (the simulator's: one id per ``token_scale``
tokens) converts between them; it is 1 in the runtime.

Not thread-safe: the runtime calls it under the leader's lock; the simulator is one thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from prefill_node.core.admission_messages import (
    AdmissionOutcome,
    Admitted,
    Rejected,
    RoundRequest,
    RoundResult,
    StageReply,
)
from prefill_node.core.coordinator import AdmissionCoordinator, DuplicateRequestError
from prefill_node.core.request import RequestSpec
from prefill_node.core.wave import ScheduledChunk, Wave
from prefill_node.core.wave_scheduler import WaveScheduler
from prefill_node.errors import InvariantError

O = TypeVar("O")  # noqa: E741 - a request's options, opaque to the leader


def in_tokens(
    outcomes: Iterable[AdmissionOutcome], token_scale: int
) -> tuple[AdmissionOutcome, ...]:
    """``outcomes`` with their lengths converted from token ids to tokens."""
    if token_scale == 1:
        return tuple(outcomes)
    return tuple(
        replace(
            o,
            num_tokens=o.num_tokens * token_scale,
            cached_len=o.cached_len * token_scale,
            promise=o.promise and replace(o.promise, leased_len=o.promise.leased_len * token_scale),
        )
        if isinstance(o, Admitted)
        else o
        for o in outcomes
    )


@dataclass(frozen=True)
class LeaderCounts:
    queue_depth: int  # submitted, not yet admitted
    inflight_requests: int  # admitted, not finished
    inflight_tokens: int  # tokens of admitted requests still to compute


@dataclass(frozen=True)
class WaveOutcome:
    """What a returned wave ended: ``finished`` requests (their last chunk passed every
    stage), ``dropped`` ones (aborted or failed, their stage state is being forgotten), and
    ``released``: a waiting request's prefix became reusable, so a round may admit it."""

    finished: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    released: bool = False


class LeaderCore(Generic[O]):
    """The coordinator's rounds and the scheduler's waves for one pipeline (module docstring).

    Rounds: ``begin_round`` / ``finish_phase`` (the caller delivers each ``RoundRequest`` to
    the stages and passes their replies back; ``round_driver.run_round`` does it by direct
    calls). Waves: ``next_wave`` plans the next one within the policy's ring; ``is_last``
    says which chunks end their prompt; ``wave_done`` accounts a wave that left the last
    stage.
    """

    def __init__(
        self,
        coordinator: AdmissionCoordinator,
        scheduler: WaveScheduler,
        *,
        token_scale: int = 1,
        follow_waves: bool = False,
    ) -> None:
        if token_scale < 1:
            raise InvariantError(f"token_scale must be >= 1, got {token_scale}")
        self.coordinator = coordinator
        self.scheduler = scheduler
        self._scale = token_scale
        self._follow_waves = follow_waves
        self._options: dict[str, O] = {}
        self._dirty = False
        self._to_follow: dict[str, RequestSpec] = {}  # admitted, first chunk not in a wave yet
        self._followed: list[RequestSpec] = []  # in a wave since the last take_follow
        self._forgets: list[str] = []  # stage-side cleanups since the last take_follow

    # -- admission -----------------------------------------------------------------------------
    def check_fits(self, num_tokens: int) -> Rejected | None:
        """Rejected if a prompt of ``num_tokens`` exceeds some stage's whole cache."""
        return self.coordinator.check_fits("", num_tokens // self._scale)

    def enqueue(self, spec: RequestSpec, options: O | None = None) -> Rejected | None:
        """Queue ``spec`` (FCFS); Rejected at once if it can never fit on some stage.
        DuplicateRequestError while its id is still known (queued, running, or aborted with
        its stage-side cleanup waiting for chunks in flight)."""
        rid = spec.request_id
        if rid in self.scheduler:
            raise DuplicateRequestError(
                f"request id {rid!r} is still in the pipeline; use a fresh id"
            )
        rejected = self.coordinator.enqueue(spec)
        if rejected is not None:
            return rejected
        if options is not None:
            self._options[rid] = options
        if self._follow_waves:
            self._to_follow[rid] = spec
        self._dirty = True
        return None

    def has_round_work(self) -> bool:
        """Something changed since the last round and the coordinator has work."""
        return self._dirty and self.coordinator.has_work()

    def begin_round(self) -> RoundRequest | None:
        """The first phase's message (None: nothing queued or to forget)."""
        self._dirty = False
        return self.coordinator.begin_round()

    def finish_phase(self, replies: Sequence[StageReply]) -> RoundRequest | RoundResult:
        """The next phase's message, or the round's result (lengths in tokens), applied:
        admitted requests are scheduled, rejected ones forgotten, cuts placed."""
        step = self.coordinator.finish_phase(replies)
        if isinstance(step, RoundRequest):
            return step
        outcomes = in_tokens(step.outcomes, self._scale)
        for out in outcomes:
            if isinstance(out, Admitted):
                promise = out.promise
                self.scheduler.admit(
                    out.request_id,
                    out.cached_len,
                    out.num_tokens,
                    after=promise.producer if promise else None,
                    fallback=promise.leased_len if promise else out.cached_len,
                )
                self._dirty = True  # progress: the next queued requests may fit
            elif isinstance(out, Rejected):
                self._options.pop(out.request_id, None)
                self._to_follow.pop(out.request_id, None)
        for rid, positions in self.coordinator.take_cuts().items():  # waiters' prefix ends
            for position in sorted(positions):
                self.scheduler.cut(rid, position * self._scale)
        return replace(step, outcomes=outcomes)

    def abort(self, request_id: str) -> bool:
        """Stop scheduling the request and drop its options (stage cleanup waits for its
        chunks in flight); True when it had been admitted, False when it was still queued
        (or unknown)."""
        self._dirty = True
        self._options.pop(request_id, None)
        admitted = request_id in self.scheduler
        if self.scheduler.abort(request_id):
            self._forget(request_id)
        return admitted

    def _forget(self, request_id: str) -> None:
        """Every stage drops the request: through the coordinator's next round, and under
        ``follow_waves`` the stages after the first through the next wave."""
        self.coordinator.abort(request_id)
        self._options.pop(request_id, None)
        if self._follow_waves:
            self._forgets.append(request_id)
            self._to_follow.pop(request_id, None)

    # -- waves ---------------------------------------------------------------------------------
    def next_wave(self) -> Wave | None:
        """The next wave (within the policy's ring), or None (ring full, or nothing to run)."""
        wave = self.scheduler.next_wave()
        if wave is not None and self._to_follow:
            for c in wave.chunks:
                spec = self._to_follow.pop(c.request_id, None)
                if spec is not None:
                    self._followed.append(spec)
        return wave

    def is_first(self, chunk: ScheduledChunk) -> bool:
        """True when ``chunk`` is its request's first (while the request runs): what is sent
        to the stages once goes with it."""
        return self.scheduler.is_first(chunk)

    def is_last(self, chunk: ScheduledChunk) -> bool:
        """True when ``chunk`` ends its request's prompt (while the request runs)."""
        return self.scheduler.is_last(chunk)

    def options(self, request_id: str) -> O | None:
        """What ``enqueue`` was given for the request (None once it left or was aborted)."""
        return self._options.get(request_id)

    def take_follow(self) -> tuple[tuple[RequestSpec, ...], tuple[str, ...]]:
        """``follow_waves``: the prompts admitted since the last call whose first chunk is in
        a wave taken since, and the stage-side cleanups since; both then start empty."""
        out = (tuple(self._followed), tuple(self._forgets))
        self._followed, self._forgets = [], []
        return out

    def wave_done(self, wave_id: int, failed: Iterable[str] = ()) -> WaveOutcome:
        """Account a wave that left the last stage; ``failed``: requests a stage failed."""
        done = self.scheduler.wave_done(wave_id, set(failed))
        for rid in done.dropped:  # aborted or failed: every stage drops what it still holds
            self._forget(rid)
        for rid in done.finished:
            self.coordinator.finished(rid)
            self._options.pop(rid, None)
        released = False
        for rid, end in done.computed:  # every stage cached these chunks' full blocks
            released |= self.coordinator.computed(rid, end // self._scale)
        if done.dropped or done.finished or released:
            self._dirty = True  # capacity or a prefix came back: waiting requests may go
        return WaveOutcome(done.finished, done.dropped, released)

    # -- views ---------------------------------------------------------------------------------
    def counts(self) -> LeaderCounts:
        return LeaderCounts(
            self.coordinator.num_queued,
            self.scheduler.num_running,
            self.scheduler.remaining_tokens,
        )

    @property
    def waves_in_flight(self) -> int:
        return self.scheduler.waves_in_flight

    @property
    def idle(self) -> bool:
        """No admitted work and no wave in flight."""
        return self.scheduler.idle
