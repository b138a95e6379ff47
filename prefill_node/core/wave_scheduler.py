"""The leader's wave scheduling: admitted requests' progress, waves from the planner, completion.

Sans-IO and single-threaded; ``leader.LeaderCore`` owns it (for the runtime, under the
leader's lock, and for the simulator), so both schedule the same waves for the same admitted
work. Admission itself (the coordinator's rounds) is not here: the leader reports each
admitted request with ``admit`` and owns the stage-side cleanup this object asks for.

Contracts:

- ``admit`` starts a request at its cached length; ``next_wave`` plans the next wave over
  the admitted, unscheduled work in FCFS order (the policy's planner) and takes its chunks,
  or returns None when the ring of ``policy.ring_size`` waves is full or nothing can run.
  Under a policy without pipelined chunks a request with a chunk in flight is skipped until
  that chunk returns (TensorRT-LLM's ``inflight_req_ids``). ``cut`` asks that a chunk of a
  request end at a given position (requests waiting for its blocks below it start sooner).
- A request promised blocks another one is computing (admitted ``after`` its producer) is
  held back until the producer's chunk that ends them has been taken into a wave, so its
  first chunk runs in a later wave and every stage has cached them by then (stages run
  waves in order). If the producer is aborted before that chunk was taken, or fails, while
  the request's first chunk is not taken yet, the request starts at its ``fallback`` (its
  lease) instead and computes them itself.
- ``wave_done`` accounts a wave that left the last stage. A request FINISHES when its last
  chunk has returned; one whose earlier chunk returned has COMPUTED the prompt up to that
  chunk's end on every stage; a request that was aborted (``abort``) or failed (named in
  ``failed``) is DROPPED once none of its chunks is in flight, and only then may the caller
  free its blocks on the stages, so a stage never frees blocks a forward is writing.
- ``abort`` returns True when the caller may release the request's stage-side state now
  (never admitted here, or nothing in flight); False when that waits for ``wave_done``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from prefill_node.core.planner import WavePlanner
from prefill_node.core.policy import Policy
from prefill_node.core.wave import ScheduledChunk, UnscheduledWork, Wave
from prefill_node.errors import InvariantError


@dataclass
class RequestProgress:
    """An admitted request: tokens ``[next_start, end)`` are unscheduled. Read-only outside
    ``WaveScheduler``."""

    request_id: str
    cached_len: int
    next_start: int
    end: int
    chunks_in_flight: int = 0
    aborted: bool = False
    cuts: set[int] = field(default_factory=set)  # positions a chunk should end at (``cut``)
    after: str | None = None  # a promise's producer, until the first chunk is taken
    fallback: int = 0  # where it starts if the producer is dropped first (its lease)


@dataclass(frozen=True)
class WaveDone:
    """What a returned wave ended: ``finished`` requests (their last chunk passed every stage)
    and ``dropped`` ones (aborted or failed, nothing left in flight: free their blocks);
    ``computed``: (request id, end) of the other requests' chunks that passed every stage."""

    finished: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    computed: tuple[tuple[str, int], ...] = ()


class WaveScheduler:
    """Per-request progress + the planner + the ring of in-flight waves (module docstring)."""

    def __init__(self, policy: Policy, planner: WavePlanner) -> None:
        if planner.config.num_stages != policy.num_stages:
            raise InvariantError("planner and policy disagree on the number of stages")
        self.policy = policy
        self.planner = planner
        self._progress: OrderedDict[str, RequestProgress] = OrderedDict()
        self._waves: dict[int, Wave] = {}

    # -- admission ---------------------------------------------------------------------------
    def admit(
        self,
        request_id: str,
        cached_len: int,
        num_tokens: int,
        after: str | None = None,
        fallback: int = 0,
    ) -> None:
        """Start scheduling an admitted request at ``cached_len`` (FCFS after the others);
        with a promise, not before ``after``'s chunk reaching ``cached_len`` is taken, or at
        ``fallback`` if that producer goes first (module docstring)."""
        if request_id in self._progress:
            raise InvariantError(f"request {request_id!r} admitted twice")
        if not 0 <= cached_len < num_tokens or not 0 <= fallback <= cached_len:
            raise InvariantError(
                f"request {request_id!r}: cached {cached_len} of {num_tokens} tokens"
            )
        self._progress[request_id] = RequestProgress(
            request_id, cached_len, cached_len, num_tokens, after=after, fallback=fallback
        )
        if after is not None and after in self._progress and self._progress[after].aborted:
            self._orphan(after, failed=True)  # dropped while this one was being admitted

    def _waits(self, p: RequestProgress) -> bool:
        """A promised request whose producer's chunk ending its prefix is not taken yet."""
        producer = self._progress.get(p.after) if p.after is not None else None
        return producer is not None and producer.next_start < p.cached_len

    def _orphan(self, producer: str, *, failed: bool) -> None:
        """``producer`` was aborted (its chunks in flight still run) or failed: the requests
        promised its blocks whose first chunk is not taken fall back to their lease, unless
        an aborted producer's chunk that ends their prefix is already running."""
        for p in self._progress.values():
            if p.after == producer and (failed or self._waits(p)):
                p.cached_len = p.next_start = p.fallback
                p.after = None

    def cut(self, request_id: str, position: int) -> None:
        """End a chunk of ``request_id`` at token ``position`` (not beyond it), when the
        planner gets there: others wait for the blocks below it. Ignored for an unknown
        request or a position it has already scheduled."""
        p = self._progress.get(request_id)
        if p is not None and p.next_start < position < p.end:
            p.cuts.add(position)

    def abort(self, request_id: str) -> bool:
        """Stop scheduling ``request_id``; True when its stage state may be released now."""
        p = self._progress.get(request_id)
        if p is None:
            return True
        p.aborted = True
        self._orphan(request_id, failed=False)
        if p.chunks_in_flight:
            return False
        del self._progress[request_id]
        return True

    # -- waves -------------------------------------------------------------------------------
    @property
    def ring_full(self) -> bool:
        return len(self._waves) >= self.policy.ring_size

    def schedulable(self) -> list[UnscheduledWork]:
        """The planner's input: admitted, unscheduled work, FCFS."""
        one_at_a_time = not self.policy.pipelined_chunks
        return [
            UnscheduledWork(rid, p.next_start, min(p.cuts, default=p.end), p.cached_len)
            for rid, p in self._progress.items()
            if not p.aborted
            and p.next_start < p.end
            and not (one_at_a_time and p.chunks_in_flight)
            and not self._waits(p)
        ]

    def next_wave(self) -> Wave | None:
        """Plan and take the next wave, or None (ring full, or nothing to run)."""
        if self.ring_full:
            return None
        work = self.schedulable()
        wave = self.planner.plan(work, idle=not self._waves) if work else None
        if wave is None or not wave.chunks:
            return None
        for c in wave.chunks:
            p = self._progress[c.request_id]
            if c.start != p.next_start or c.end > p.end:
                raise InvariantError(f"planner scheduled {c} out of order")
            p.next_start = c.end
            p.chunks_in_flight += 1
            p.after = None  # the stages now need the promised blocks: no fallback
            p.cuts = {x for x in p.cuts if x > c.end}
        self._waves[wave.wave_id] = wave
        return wave

    def is_first(self, chunk: ScheduledChunk) -> bool:
        """True when ``chunk`` starts its request's schedule, at its cached length (valid
        while the request runs)."""
        return chunk.start == self._progress[chunk.request_id].cached_len

    def is_last(self, chunk: ScheduledChunk) -> bool:
        """True when ``chunk`` ends its request's prompt (valid while the request runs)."""
        return chunk.end == self._progress[chunk.request_id].end

    def wave_done(self, wave_id: int, failed: Collection[str] = ()) -> WaveDone:
        """Account a wave that left the last stage (module docstring)."""
        wave = self._waves.pop(wave_id, None)
        if wave is None:
            return WaveDone()
        finished: list[str] = []
        dropped: list[str] = []
        computed: list[tuple[str, int]] = []
        for c in wave.chunks:
            p = self._progress.get(c.request_id)
            if p is None:
                continue
            p.chunks_in_flight -= 1
            if c.request_id in failed:
                p.aborted = True
                self._orphan(c.request_id, failed=True)
            if not p.aborted and c.end < p.end:
                computed.append((c.request_id, c.end))
            if p.chunks_in_flight > 0:
                continue
            if p.aborted:
                del self._progress[c.request_id]
                dropped.append(c.request_id)
            elif c.end == p.end:
                del self._progress[c.request_id]
                finished.append(c.request_id)
        return WaveDone(tuple(finished), tuple(dropped), tuple(computed))

    # -- views -------------------------------------------------------------------------------
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._progress

    def request(self, request_id: str) -> RequestProgress:
        return self._progress[request_id]

    def running(self) -> Iterator[RequestProgress]:
        """Admitted, unfinished requests in FCFS order (aborted ones with chunks in flight
        included)."""
        return iter(self._progress.values())

    @property
    def num_running(self) -> int:
        return len(self._progress)

    @property
    def remaining_tokens(self) -> int:
        """Tokens of admitted requests not yet scheduled."""
        return sum(p.end - p.next_start for p in self._progress.values())

    @property
    def waves_in_flight(self) -> int:
        return len(self._waves)

    @property
    def idle(self) -> bool:
        """No admitted work and no wave in flight."""
        return not self._progress and not self._waves
