"""MPU wave planner: chooses each wave's token budget and packs admitted work into waves, FCFS.

WAVEPP.md section 4, with these readings of the places where the text is terse:

- Ring ``R = 2P`` waves in flight, target ``S = R + (F-1)P`` waves available.
  Candidates ``b_0 = M``, ``b_{j+1} = max(b_min, alignDown_B(b_j / 2))`` until ``b_min``.
  ``n(b) = max(W / b, N_{>b/2})`` with real division: ``n(b) >= S`` is tested exactly as
  ``W >= S*b or N_{>b/2} >= S``. The target is the largest candidate with ``n(b) >= S``,
  else ``b_min``.
- Hysteresis, one decision per planned wave: a decision above the current budget extends a
  "raise" streak, one below extends a "lower" streak, one equal (or in the other direction)
  ends the streak. A raise happens after ``R/2`` consecutive raise decisions, a lowering
  after ``P``; the new budget is the most conservative target of the streak (the smallest
  when raising, the largest when lowering), so a budget moves only as far as every decision
  of the streak agreed. With ``R = 2P`` both thresholds equal ``P``; they stay separate
  settings (``raise_after`` / ``lower_after``).
- Drain bound (``wave_overhead_tokens`` k > 0, P > 1; not in the paper): a wave that holds
  work nothing else is queued behind keeps the other stages idle while it fills the
  pipeline and again while it drains. Chunks of one request pass P stages in order, so ``n``
  equal waves of ``W`` tokens take about ``(n + P - 1) * (k + W/n)`` token-times (the
  slowest wave is paid P - 1 extra times: once per stage it must cross while nothing follows
  it), least at ``b = W/n = sqrt(W * k / (P - 1))``. The target is therefore never above
  that size (block-aligned up, at least one block), even below ``b_min``: a lone prompt or a
  shallow burst gets waves small enough that fill and drain stay short, a deep queue (``W``
  large) still gets ``M``. k is a wave's fixed cost (weight reads, dispatch, the hop between
  stages) in tokens of compute: on a CPU a few tens of tokens, on a GPU that reads its
  weights every wave likely thousands, where the bound would bind on short work only. With
  k = 0 the target is MPU's. The runtime leaves it off by default: measured on CPU it
  loses (``CPU_WAVE_OVERHEAD_TOKENS``).
- With a drain bound, hysteresis applies only while waves are in flight: a wave planned on
  an idle pipeline (``plan(..., idle=True)``) takes the target at once, since no running
  wave's size can leave stages waiting behind it (a lone prompt's first waves would
  otherwise run at the budget the last burst left, M after a deep one).
- Packing: requests in FCFS order, at most one chunk per request per wave. A request whose
  whole remainder fits the room left takes it all: a request's FINAL remainder is always
  allowed, however small. Otherwise it takes a block-aligned fragment of the room, but only
  if that fragment is at least ``max(b_min, b/2)`` tokens (the fragment rule); if not, the
  request waits for the next wave and later requests may still use the room it declined
  (they never delay it: its next chunk goes in the next wave either way). An empty wave
  always takes a chunk of its first request, so planning never stalls.
- Cost-aware mode: same budget decision, but a wave is filled up to a TIME budget
  ``tau(b) = b * per_token_cost(ref)``, where ``ref`` is the token-weighted mean of
  ``(computed_from + end) / 2`` over the pending work: the average attended context of
  the tokens each request computes, from its cached length on admission (``first_start``)
  to its end - ``end/2`` for a cold prompt, the middle of the suffix for a prompt with a
  cached prefix - which does not drift as a request progresses. (Taking ``end/2`` for
  every prompt, as this mode first did, sized the waves of prefix-reuse work for half its
  real context: 3.5K-token waves where MPU packs 7K on GLM-5-class 64K 90%-reuse work,
  0.89x trtllm at concurrency 32.) Long-context chunks therefore get fewer tokens and
  short-context chunks more (never more than ``M`` tokens per wave, the memory cap). The
  fragment rule applies in time: ``max(tau(b_min), tau(b)/2)``.

The planner is sans-IO and keeps no per-request state: the caller passes the FCFS list of
schedulable work each time and advances it by the returned chunks.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.wave import ScheduledChunk, UnscheduledWork, Wave
from prefill_node.errors import InvalidRequestError, InvariantError


class InvalidPlannerConfigError(InvalidRequestError):
    """A planner setting is out of range; the message names it."""


class PlannerMode(enum.Enum):
    """Budget policy; the ablations of the simulator select one each."""

    FIXED = "fixed"  # always M: the trtllm baseline's budget
    MPU = "mpu"  # MPU with hysteresis
    MPU_NO_HYSTERESIS = "mpu-nohyst"  # MPU, budget follows every decision
    COST_AWARE = "cost"  # MPU budget, waves equalised in estimated time


DEFAULT_PLANNER_MODE = PlannerMode.COST_AWARE
"""The mode to run when a cost model is at hand (the simulator always has one). Ablation
on ``wavepp sim --sweep paper`` (80 settings: both PP4 presets; cold, 90% reuse, mixed at
64K/128K/256K and 4K suffix at 128K; concurrency 1, 8, 32, 128; trtllm = TensorRT-LLM's
PP executor loops), wave/baseline input throughput: cost-aware min 1.002x, geometric mean
1.395x, no setting more than 3% below trtllm; plain MPU min 0.948x (MiniMax-class cold
256K at c = 8, 32, 128), geometric mean 1.364x; cost-aware beats MPU in 49 settings, MPU
beats it in 5, 26 ties. The first cost-aware reference (``end/2`` for every prompt) had a
geometric mean of 1.435x but lost 0.886x at GLM-5-class 90% reuse 64K c = 32: its waves
on prefix-reuse work were half as large (3.5K vs 7K tokens there), which pipelines a lone
request's suffix across the stages at c = 1 (+25-40% there, below what b_min allows MPU)
but drowns mid-load work in per-wave weight reads. ``PlannerConfig`` itself defaults to
plain MPU, which needs no cost model."""


CPU_WAVE_OVERHEAD_TOKENS = 16
"""A wave's fixed cost in tokens of compute on this project's CPU runtime, the drain bound's
k that bench/stage_occupancy.py tries (``wavepp serve --wave-overhead-tokens``; the default
is 0, off). bench/wave_forward.py on the bundled model, one thread, float32 (AMD EPYC
guest, 2026-12-07): a cold chunk of 32 tokens takes 94 ms and of 64 tokens 157 ms (about
2 ms per token), so a forward costs ~30 ms, ~15 tokens, before its first token. Measured
whole, the bound still loses on that CPU (4-18% fewer tokens per second on the peer cases,
docs/vllm.md): smaller chunks also cost more per token (a 64-token chunk after 1,024 cached
tokens runs 5% slower per token than a 512-token one), which this model of the cost leaves
out. The simulator sets no k: its roofline has no per-wave fixed cost term yet."""


@dataclass(frozen=True)
class PlannerConfig:
    """Planner settings, validated once. Token counts must be multiples of ``block_size``."""

    num_stages: int  # P
    max_wave_tokens: int  # M
    min_wave_tokens: int  # b_min
    block_size: int  # B
    fill_factor: int = 2  # F
    max_wave_requests: int = 128
    mode: PlannerMode = PlannerMode.MPU
    fragment_rule: bool = True  # False: fill every wave to the brim (TRT-LLM chunking)
    wave_overhead_tokens: int = 0  # k of the drain bound; 0: no drain bound

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidPlannerConfigError:
            return InvalidPlannerConfigError(f"planner config: {msg}")

        if self.num_stages < 1:
            raise bad(f"num_stages must be >= 1, got {self.num_stages}")
        if self.block_size < 1:
            raise bad(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < self.min_wave_tokens <= self.max_wave_tokens:
            raise bad(
                f"need 0 < min_wave_tokens <= max_wave_tokens, got "
                f"{self.min_wave_tokens}, {self.max_wave_tokens}"
            )
        for name in ("min_wave_tokens", "max_wave_tokens"):
            if getattr(self, name) % self.block_size:
                raise bad(f"{name} must be a multiple of block_size {self.block_size}")
        if self.fill_factor < 1:
            raise bad(f"fill_factor must be >= 1, got {self.fill_factor}")
        if self.max_wave_requests < 1:
            raise bad(f"max_wave_requests must be >= 1, got {self.max_wave_requests}")
        if self.wave_overhead_tokens < 0:
            raise bad(f"wave_overhead_tokens must be >= 0, got {self.wave_overhead_tokens}")

    @property
    def ring_size(self) -> int:
        """R = 2P: waves in flight at most."""
        return 2 * self.num_stages

    @property
    def target_waves(self) -> int:
        """S = R + (F-1)P: waves the planner wants available."""
        return self.ring_size + (self.fill_factor - 1) * self.num_stages

    @property
    def raise_after(self) -> int:
        return max(1, self.ring_size // 2)

    @property
    def lower_after(self) -> int:
        return self.num_stages

    def candidate_budgets(self) -> tuple[int, ...]:
        """b_0 = M, b_{j+1} = max(b_min, alignDown_B(b_j / 2)), down to b_min, largest first."""
        out = [self.max_wave_tokens]
        while out[-1] > self.min_wave_tokens:
            half = out[-1] // 2 // self.block_size * self.block_size
            out.append(max(self.min_wave_tokens, half))
        return tuple(out)


def wave_budget(max_wave_tokens: int, block_size: int) -> int:
    """The wave budget M as the planner uses it: ``max_wave_tokens`` rounded up to whole
    blocks (the planner plans in blocks); both must be >= 1."""
    if block_size < 1 or max_wave_tokens < 1:
        raise InvalidPlannerConfigError(
            f"the block size ({block_size}) and the wave budget --max-chunk-tokens "
            f"({max_wave_tokens}) must be >= 1"
        )
    return -(-max_wave_tokens // block_size) * block_size


def default_min_wave_tokens(max_wave_tokens: int, block_size: int) -> int:
    """b_min when none is given: M/2 in whole blocks (the paper's 8,192 of 16,384), at least
    one block."""
    return max(block_size, max_wave_tokens // 2 // block_size * block_size)


def check_min_wave_tokens(
    min_wave_tokens: int | None, max_wave_tokens: int, block_size: int
) -> None:
    """Reject a b_min a pipeline cannot plan with (None: the default), naming the option."""
    if min_wave_tokens is None:
        return
    if not block_size <= min_wave_tokens <= max_wave_tokens or min_wave_tokens % block_size:
        raise InvalidPlannerConfigError(
            f"--min-wave-tokens must be a multiple of the block size {block_size} between "
            f"{block_size} and the wave budget {max_wave_tokens} (--max-chunk-tokens), got "
            f"{min_wave_tokens}"
        )


def target_budget(config: PlannerConfig, work: Sequence[UnscheduledWork]) -> int:
    """The decision without hysteresis: the largest b with n(b) >= S (else b_min), capped by
    the drain bound when k is set (module docstring)."""
    total = sum(w.remaining for w in work)
    s = config.target_waves
    target = config.min_wave_tokens
    for b in config.candidate_budgets():
        if total >= s * b or sum(1 for w in work if 2 * w.remaining > b) >= s:
            target = b
            break
    return min(target, drain_bound(config, total))


def drain_bound(config: PlannerConfig, total_tokens: int) -> int:
    """The wave size that keeps fill and drain shortest for ``total_tokens`` of work with
    nothing behind it: ``sqrt(W * k / (P - 1))`` aligned up to whole blocks, at least one
    block; ``M`` when there is no bound (k = 0, or one stage: nothing to fill)."""
    k, p, bs = config.wave_overhead_tokens, config.num_stages, config.block_size
    if k == 0 or p == 1:
        return config.max_wave_tokens
    best = math.ceil(math.sqrt(total_tokens * k / (p - 1)))
    return min(config.max_wave_tokens, max(bs, -(-best // bs) * bs))


class WavePlanner:
    """Plans one wave at a time; owns only the current budget and the hysteresis streak."""

    def __init__(self, config: PlannerConfig, cost_model: ChunkCostModel | None = None) -> None:
        if config.mode is PlannerMode.COST_AWARE and cost_model is None:
            raise InvalidPlannerConfigError("planner config: mode 'cost' needs a cost model")
        self.config = config
        self.cost_model = cost_model
        self._budget = config.max_wave_tokens
        self._streak = 0  # +n: n raise decisions in a row, -n: n lower decisions
        self._streak_bound = 0  # most conservative target of the streak
        self._next_wave_id = 0

    @property
    def budget(self) -> int:
        """The token budget the next wave will be packed with (before the next decision)."""
        return self._budget

    def decide_budget(self, work: Sequence[UnscheduledWork], idle: bool = False) -> int:
        """Make one budget decision for ``work`` and return the budget to pack with; ``idle``:
        no wave is in flight, so the target applies at once (module docstring)."""
        cfg = self.config
        if cfg.mode is PlannerMode.FIXED:
            return self._budget
        target = target_budget(cfg, work)
        idle = idle and cfg.wave_overhead_tokens > 0
        if cfg.mode is PlannerMode.MPU_NO_HYSTERESIS or idle:
            self._budget, self._streak = target, 0
            return target
        if target == self._budget:
            self._streak = 0
        elif target > self._budget:
            if self._streak <= 0:
                self._streak, self._streak_bound = 0, target
            self._streak += 1
            self._streak_bound = min(self._streak_bound, target)
            if self._streak >= cfg.raise_after:
                self._budget, self._streak = self._streak_bound, 0
        else:
            if self._streak >= 0:
                self._streak, self._streak_bound = 0, target
            self._streak -= 1
            self._streak_bound = max(self._streak_bound, target)
            if -self._streak >= cfg.lower_after:
                self._budget, self._streak = self._streak_bound, 0
        return self._budget

    def plan(self, work: Sequence[UnscheduledWork], idle: bool = False) -> Wave | None:
        """Decide the budget and pack the next wave from ``work`` (FCFS); None if no work.
        ``idle``: no wave of this pipeline is in flight (``decide_budget``)."""
        if not work:
            return None
        budget = self.decide_budget(work, idle)
        if self.config.mode is PlannerMode.COST_AWARE:
            chunks = self._pack_by_time(work, budget)
        else:
            chunks = self._pack_by_tokens(work, budget)
        wave = Wave(self._next_wave_id, chunks)
        self._next_wave_id += 1
        return wave

    def _pack_by_tokens(
        self, work: Sequence[UnscheduledWork], budget: int
    ) -> tuple[ScheduledChunk, ...]:
        cfg = self.config
        min_fragment = max(cfg.min_wave_tokens, budget // 2) if cfg.fragment_rule else 1
        chunks: list[ScheduledChunk] = []
        used = 0
        for w in work:
            if len(chunks) >= cfg.max_wave_requests or used >= budget:
                break
            room = budget - used
            if w.remaining <= room:
                length = w.remaining
            else:
                length = room // cfg.block_size * cfg.block_size
                if chunks and length < min_fragment:
                    continue
                if length == 0:  # empty wave, budget below one block: take one block
                    length = min(w.remaining, cfg.block_size)
            chunks.append(ScheduledChunk(w.request_id, w.next_start, length))
            used += length
        return tuple(chunks)

    def _pack_by_time(
        self, work: Sequence[UnscheduledWork], budget: int
    ) -> tuple[ScheduledChunk, ...]:
        cfg, cost = self.config, self.cost_model
        if cost is None:
            raise InvariantError("cost-aware packing without a cost model")
        total = sum(w.remaining for w in work)
        ref = sum(w.remaining * (w.computed_from + w.end) / 2 for w in work) / total
        tau = budget * cost.per_token_cost(ref)
        min_fragment = max(cfg.min_wave_tokens * cost.per_token_cost(ref), tau / 2)
        if not cfg.fragment_rule:
            min_fragment = 0.0
        chunks: list[ScheduledChunk] = []
        used_s, used_tokens = 0.0, 0
        for w in work:
            full = used_tokens >= cfg.max_wave_tokens or used_s >= tau
            if len(chunks) >= cfg.max_wave_requests or full:
                break
            token_room = cfg.max_wave_tokens - used_tokens
            fit = min(cost.max_length(w.next_start, tau - used_s), token_room)
            if w.remaining <= fit:
                length = w.remaining
            else:
                length = fit // cfg.block_size * cfg.block_size
                if chunks and (length == 0 or cost.chunk_cost(w.next_start, length) < min_fragment):
                    continue
                if length == 0:  # one chunk is over the time budget on its own
                    length = min(w.remaining, cfg.block_size)
            chunks.append(ScheduledChunk(w.request_id, w.next_start, length))
            used_s += cost.chunk_cost(w.next_start, length)
            used_tokens += length
        return tuple(chunks)
