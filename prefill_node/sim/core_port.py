"""The simulator's handle on the real admission core: one coordinator, one StageAdmission per stage.

Nothing here models the core: every call goes to ``AdmissionCoordinator``,
``StageAdmission`` and ``round_driver.run_round`` (the leader's admission round with direct
calls instead of a rounds plane). The pipeline simulator drives the coordinator through
the core's ``LeaderCore``, as both engines' leader does, and the stages through
``materialise`` / ``cache_computed`` / ``complete`` here; the cluster simulator, which runs whole
requests instead of waves, uses ``run_round`` and ``finish``. The port only adds what a
simulation needs: seeding prefixes into every stage's cache before the measured run, and turning a
``StageStateMismatch`` (which in the real runtime fails the request) into an
``InvariantError``, because the simulator never sends a chunk the leader did not schedule,
so a mismatch here is a bug.

Token scale (see ``workloads.py``): the core sees one id per ``token_scale`` real tokens
and blocks of ``block_size / token_scale`` ids; the port converts chunk positions and
cached lengths between real tokens (simulator, planner, roofline) and ids (core).
"""

from __future__ import annotations

from collections.abc import Sequence

from prefill_node.core.admission_messages import AdmissionOutcome, Admitted, Rejected
from prefill_node.core.coordinator import AdmissionCoordinator, CoordinatorConfig
from prefill_node.core.execution_results import StageStateMismatch
from prefill_node.core.hashing import ExtraKeys
from prefill_node.core.kv_events import KVEvent
from prefill_node.core.leader import in_tokens
from prefill_node.core.request import RequestSpec
from prefill_node.core.round_driver import run_round
from prefill_node.core.stage_admission import StageAdmission, StageConfig
from prefill_node.core.wave import ScheduledChunk
from prefill_node.errors import InvariantError


class CorePort:
    """P stages' admission state plus the leader's coordinator, for one simulated pipeline.

    ``stage_headroom_blocks``: each stage's lease/escrow headroom, in blocks; the simulator
    takes it from ``Policy.headroom_blocks``, the rule the runtime's stages use.
    """

    def __init__(
        self,
        block_size: int,
        token_scale: int,
        stage_num_blocks: Sequence[int],
        stage_num_layers: Sequence[int],
        *,
        model_id: str,
        stage_headroom_blocks: Sequence[int],
        max_round_requests: int,
        enable_kv_events: bool = False,
        share_inflight_prefix: bool = False,
    ) -> None:
        if token_scale < 1 or block_size % token_scale:
            raise InvariantError(f"token_scale {token_scale} must divide block_size {block_size}")
        self.block_size, self.scale = block_size, token_scale
        core_block = block_size // token_scale
        self.extra = ExtraKeys(model_id=model_id)
        self.stages = [
            StageAdmission(
                StageConfig(
                    stage=s,
                    num_blocks=n,
                    block_size=core_block,
                    num_layers=layers,
                    headroom_blocks=headroom,
                    enable_kv_events=enable_kv_events,
                )
            )
            for s, (n, layers, headroom) in enumerate(
                zip(stage_num_blocks, stage_num_layers, stage_headroom_blocks, strict=True)
            )
        ]
        self.coordinator = AdmissionCoordinator(
            CoordinatorConfig(
                block_size=core_block,
                stage_num_blocks=tuple(stage_num_blocks),
                max_requests_per_round=max_round_requests,
                share_inflight_prefix=share_inflight_prefix,
            )
        )

    def spec(self, request_id: str, tokens: Sequence[int]) -> RequestSpec:
        return RequestSpec(request_id, tuple(tokens), self.extra)

    def enqueue(self, spec: RequestSpec) -> Rejected | None:
        """Queue for admission (FCFS); Rejected at once if it can never fit on some stage."""
        return self.coordinator.enqueue(spec)

    def next_round_ids(self) -> list[str]:
        """Requests the next round will look at (the head of the coordinator's queue)."""
        return self.coordinator.queued_ids()[: self.coordinator.config.max_requests_per_round]

    @property
    def num_queued(self) -> int:
        return self.coordinator.num_queued

    def run_round(self) -> tuple[AdmissionOutcome, ...]:
        """One whole admission round over every stage, by direct calls (lengths in tokens)."""
        return in_tokens(run_round(self.coordinator, self.stages), self.scale)

    def _ids(self, tokens: int) -> int:
        if tokens % self.scale:
            raise InvariantError(f"position {tokens} is not a multiple of token_scale {self.scale}")
        return tokens // self.scale

    def materialise(self, stage: int, chunk: ScheduledChunk) -> None:
        table = self.stages[stage].materialise(
            chunk.request_id, self._ids(chunk.start), self._ids(chunk.length)
        )
        if isinstance(table, StageStateMismatch):
            raise InvariantError(f"simulated chunk refused: {table.to_error()}")

    def complete(self, stage: int, request_id: str) -> None:
        """The request's last chunk left ``stage``: it completes there (pins drop)."""
        done = self.stages[stage].complete(request_id)
        if isinstance(done, StageStateMismatch):
            raise InvariantError(f"simulated completion refused: {done.to_error()}")

    def finish(self, stage: int, request_id: str) -> None:
        """``complete``, and after the last stage the coordinator's ``finished`` (for the
        drivers without a ``LeaderCore``: seeding, the cluster simulator)."""
        self.complete(stage, request_id)
        if stage == len(self.stages) - 1:  # cached on every stage now
            self.coordinator.finished(request_id)

    def cache_computed(self, stage: int, chunk: ScheduledChunk) -> None:
        """A non-last chunk left ``stage``: its full blocks become reusable there (the
        ``LeaderCore`` tells the coordinator once the wave has left the last stage)."""
        self.stages[stage].cache_computed(chunk.request_id, self._ids(chunk.end))

    def seed(self, request_id: str, tokens: Sequence[int], extra: ExtraKeys | None = None) -> None:
        """Prefill ``tokens`` (ids) instantly on every stage, leaving them cached, unpinned;
        ``extra``: their cache identity (None: the port's, no salt)."""
        spec = RequestSpec(request_id, tuple(tokens), extra or self.extra)
        outcomes = [o for o in (self.enqueue(spec),) if o]
        outcomes += self.run_round()
        if len(outcomes) != 1 or not isinstance(outcomes[0], Admitted):
            raise InvariantError(f"seeding {request_id!r} was not admitted: {outcomes}")
        cached = outcomes[0].cached_len
        chunk = ScheduledChunk(request_id, cached, len(tokens) * self.scale - cached)
        for s in range(len(self.stages)):
            self.materialise(s, chunk)
            self.finish(s, request_id)

    def drain_events(self, stage: int) -> list[KVEvent]:
        """Stage ``stage``'s KV events since the last call (``enable_kv_events`` only)."""
        return self.stages[stage].drain_events()

    def check_integrity(self) -> None:
        """Every stage's cache and reservation invariants (raises InvariantError)."""
        for stage in self.stages:
            stage.check_integrity()
