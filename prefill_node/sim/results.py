"""Per-request records of a simulated run and the flat summary row it reduces to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from prefill_node.sim.workloads import WorkloadSpec


@dataclass(frozen=True)
class RequestRecord:
    """Simulated times (seconds from the start of the run) of one finished request."""

    arrival: float
    admitted: float
    finished: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def latency(self) -> float:
        return self.finished - self.arrival


@dataclass(frozen=True)
class SimResult:
    """One run, flat, so a list of them is the ``--json`` output as is."""

    preset: str
    workload: str
    input_len: int
    concurrency: int
    policy: str
    seed: int
    requests: int
    completed: int
    rejected: int
    makespan_s: float
    throughput_tok_s: float  # input tokens (cached ones included) per second
    computed_tok_s: float  # tokens actually computed per second
    cached_fraction: float
    p50_latency_s: float
    p95_latency_s: float
    mean_queue_s: float  # arrival -> admitted
    waves: int
    mean_wave_tokens: float
    rounds: int
    mean_round_requests: float
    # trtllm, sync-admission: time stages wait for their loops, summed over stages (trtllm:
    # each rank's host work; sync-admission: stage 0's loop running admission rounds)
    loop_stall_s: float
    stage_utilisation: float  # mean over stages of busy / makespan

    def row(self) -> dict[str, object]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence; 0.0 if empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summarise(
    *,
    preset: str,
    workload: WorkloadSpec,
    policy: str,
    records: Sequence[RequestRecord],
    rejected: int,
    stage_busy_s: Sequence[float],
    num_waves: int,
    wave_tokens: int,
    num_rounds: int,
    round_requests: int,
    loop_stall_s: float,
) -> SimResult:
    makespan = max((r.finished for r in records), default=0.0)
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    latencies = [r.latency for r in records]
    return SimResult(
        preset=preset,
        workload=workload.kind.value,
        input_len=workload.input_len,
        concurrency=workload.concurrency,
        policy=policy,
        seed=workload.seed,
        requests=workload.num_requests,
        completed=len(records),
        rejected=rejected,
        makespan_s=makespan,
        throughput_tok_s=prompt / makespan if makespan else 0.0,
        computed_tok_s=(prompt - cached) / makespan if makespan else 0.0,
        cached_fraction=cached / prompt if prompt else 0.0,
        p50_latency_s=percentile(latencies, 50),
        p95_latency_s=percentile(latencies, 95),
        mean_queue_s=sum(r.admitted - r.arrival for r in records) / len(records)
        if records
        else 0.0,
        waves=num_waves,
        mean_wave_tokens=wave_tokens / num_waves if num_waves else 0.0,
        rounds=num_rounds,
        mean_round_requests=round_requests / num_rounds if num_rounds else 0.0,
        loop_stall_s=loop_stall_s,
        stage_utilisation=(sum(stage_busy_s) / (len(stage_busy_s) * makespan) if makespan else 0.0),
    )
