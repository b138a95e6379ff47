"""PredictionCalibration: per pipeline, how much longer answers take than the cost model
predicts (a ratio the Scorer scales its predictions by); sans-IO, driven by RouterEngine and
by tests.

Contract. The router's cost model counts FLOPs at a nominal rate, so on a given host its
seconds are off by a factor: on CPU, by orders of magnitude (optimistic), which would leave
the deadline check of the flow control blind. Each answered request is a sample: the
seconds from forwarding it to its answer over the seconds the Scorer predicted for it there
at routing (queued work + its own prefill, in cost-model seconds). A pipeline's ratio is an
exponentially weighted moving average of its samples (weight ``alpha`` on the newest),
bounded by ``[min_ratio, max_ratio]`` (every sample is clamped first). The cluster's ratio
is the same average over every pipeline's samples, starting at 1 (the cost model as it is);
a pipeline without samples of its own (new, or restarted after leaving the discovery) takes
the cluster's, and starts its own average from it: pipelines serve one model on alike
hosts, and a newcomer predicted at the bare cost model's speed would draw every request.
A ratio that got no sample for ``half_life_s`` is halfway back to 1: a pipeline that was
slow during a fault and then gets only requests that its old ratio turns away (short
deadlines) is tried again, and re-measured, instead of shunned for good.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationConfig:
    """``alpha``: the newest sample's weight (0: off, predictions stay the cost model's);
    ``min_ratio`` / ``max_ratio``: bounds of every sample and so of the ratio;
    ``half_life_s``: the ratio drifts back to 1 with this half-life while no sample comes."""

    alpha: float = 0.2
    min_ratio: float = 0.01
    max_ratio: float = 1e6
    half_life_s: float = 60.0

    def __post_init__(self) -> None:
        if not (
            0.0 <= self.alpha <= 1.0
            and 0.0 < self.min_ratio <= 1.0 <= self.max_ratio < math.inf
            and self.half_life_s > 0
        ):
            raise ValueError(
                "calibration needs 0 <= alpha <= 1, 0 < min_ratio <= 1 <= max_ratio (finite) "
                f"and half_life_s > 0; got {self}"
            )


class PredictionCalibration:
    """See the module contract. Not thread-safe: the driver holds its lock around calls."""

    def __init__(self, config: CalibrationConfig) -> None:
        self.config = config
        self._ratios: dict[str, tuple[float, float]] = {}  # pid -> (ratio, when last sampled)
        self._cluster: tuple[float, float] = (1.0, 0.0)  # over every pipeline's samples

    def ratio(self, pid: str, now: float) -> float:
        """``pid``'s ratio at ``now`` (the cluster's before its first sample)."""
        return self._decayed(self._ratios.get(pid, self._cluster), now)

    def cluster_ratio(self, now: float) -> float:
        return self._decayed(self._cluster, now)

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        ratio, when = entry
        age = now - when
        if age <= 0 or ratio == 1.0:
            return ratio
        return 1.0 + (ratio - 1.0) * 0.5 ** (age / self.config.half_life_s)

    def observe(self, pid: str, predicted_s: float, actual_s: float, now: float) -> float | None:
        """An answer from ``pid`` that took ``actual_s`` where ``predicted_s`` (cost-model
        seconds) was predicted; the new ratio, or None when the sample says nothing (a
        prediction of 0, a negative time, or calibration off)."""
        cfg = self.config
        if not (cfg.alpha > 0 and predicted_s > 0 and actual_s >= 0):
            return None
        sample = min(cfg.max_ratio, max(cfg.min_ratio, actual_s / predicted_s))
        ratio = (1.0 - cfg.alpha) * self.ratio(pid, now) + cfg.alpha * sample
        cluster = (1.0 - cfg.alpha) * self.cluster_ratio(now) + cfg.alpha * sample
        self._ratios[pid], self._cluster = (ratio, now), (cluster, now)
        return ratio

    def forget(self, pid: str) -> None:
        """``pid`` left the cluster: its next instance starts from the cluster's ratio."""
        self._ratios.pop(pid, None)

    def ratios(self, now: float) -> dict[str, float]:
        """Every sampled pipeline's ratio at ``now``."""
        return {pid: self.ratio(pid, now) for pid in self._ratios}
