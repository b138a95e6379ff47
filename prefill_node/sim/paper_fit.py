"""Fitting the two paper-fitted constants (``paper.FITTED``): ``wavepp sim --fit-paper``."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from prefill_node.core.planner import PlannerMode
from prefill_node.core.policy import trtllm_policy, wave_policy
from prefill_node.sim.paper import PAPER_FIGURES, PaperFigure
from prefill_node.sim.presets import Preset, get_preset
from prefill_node.sim.sweep import Setting, default_requests, run_setting

SCALE_RANGE, EFFICIENCY_RANGE = (0.25, 4.0), (0.05, 1.0)


class PaperFit(NamedTuple):
    """The fitted constants, the alternation rounds it took, and whether the last round
    moved both by less than the tolerance."""

    host_time_scale: float
    efficiency: float  # the first figure's preset's flops_efficiency
    rounds: int
    converged: bool


def bisect(f: Callable[[float], float], lo: float, hi: float, steps: int) -> float:
    """The x in [lo, hi] where the increasing function ``f`` crosses 0 (geometric steps)."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return math.sqrt(lo * hi)


def with_constants(preset: Preset, host_time_scale: float, efficiency: float | None) -> Preset:
    """``preset`` with the fitted constants set (``efficiency`` None: its own)."""
    out = replace(preset, host_time_scale=host_time_scale)
    if efficiency is not None:
        out = replace(out, gpu=replace(out.gpu, flops_efficiency=efficiency))
    return out


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def fit_presets(
    figures: Sequence[PaperFigure] = PAPER_FIGURES,
    requests: int | None = None,
    steps: int = 10,
    presets: Mapping[str, Preset] | None = None,
    tolerance: float = 0.005,
    max_rounds: int = 8,
) -> PaperFit:
    """Fit ``host_time_scale`` (one value for every preset: the geometric mean of the
    simulated TRT-LLM rows equals the figures') and the first figure's preset's compute
    efficiency (its simulated WavePP row equals the figure's). Each is bisected over its
    range with the other held; the two alternate until a round moves neither by more than
    ``tolerance`` (relative), at most ``max_rounds`` rounds. The two are coupled (the
    baseline's GPU time depends on the efficiency, WavePP's host work on the scale), so
    one round is not enough unless the baseline is purely host-bound. ``presets``: by
    name, where to start from (default: ``get_preset``)."""
    first = figures[0]
    presets = presets or {f.preset: get_preset(f.preset) for f in figures}
    scale = presets[first.preset].host_time_scale
    eff = presets[first.preset].gpu.flops_efficiency

    def throughput(fig: PaperFigure, wave: bool) -> float:
        own = eff if fig.preset == first.preset else None
        preset = with_constants(presets[fig.preset], scale, own)
        n = requests or default_requests(fig.concurrency)
        setting = Setting(preset, fig.kind, fig.input_len, fig.concurrency, n)
        p = preset.num_stages
        policy = wave_policy(p, PlannerMode.MPU) if wave else trtllm_policy(p)
        return run_setting(setting, policy).throughput_tok_s

    def gap_scale(k: float) -> float:  # increasing: the baseline slows as k grows
        nonlocal scale
        scale = k
        return target - _geomean([throughput(f, wave=False) for f in figures])

    def gap_eff(e: float) -> float:
        nonlocal eff
        eff = e
        return throughput(first, wave=True) - first.wave_tok_s

    target = _geomean([f.trtllm_tok_s for f in figures])
    for rounds in range(1, max_rounds + 1):
        before = (scale, eff)
        scale = bisect(gap_scale, *SCALE_RANGE, steps)
        eff = bisect(gap_eff, *EFFICIENCY_RANGE, steps)
        moved = max(abs(math.log(a / b)) for a, b in zip((scale, eff), before, strict=True))
        if moved < tolerance:
            return PaperFit(scale, eff, rounds, True)
    return PaperFit(scale, eff, max_rounds, False)
