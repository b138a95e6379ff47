"""The WavePP paper's figures beside the simulator's, each marked fitted or predicted.

Cited (secondary summaries of arXiv 2609.35263, unverified). Absolute, at 4K suffix,
131,072-token inputs, concurrency 128, TP1 x PP4 on 4x B300: TensorRT-LLM PP4 reached 416K
input tok/s on GLM-5 and 551K on MiniMax-M2; WavePP 1,213K and 1,113K (2.91x and 2.02x).
Relative (the ablation; the summaries do not say on which model): wave admission +236% over
the baseline at cold 131K c=16, read here as WavePP with a fixed budget M against
TensorRT-LLM PP4 (3.36x; the simulated WavePP always has lease and escrow, which on cold
prompts have nothing to lease); MPU -9.7% against a fixed M at 90% reuse 262K c=32. The
ablation's other figures name no setting (MPU +41.7%) or a mechanism the simulator cannot
switch off (lease + escrow +54%), and are not checked.

Two constants are FITTED on the absolute figures (``FITTED``; ``paper_fit.py`` refits them):
``host_time_scale`` on the two TensorRT-LLM rows, the GLM-5-class compute efficiency on GLM's
WavePP row. A figure is in-sample when a constant was fitted on it or on a term of it (a
ratio's), out-of-sample otherwise: of the absolute figures only MiniMax's WavePP row; both
relative figures. ``reproduce`` also runs the ablations that say what the headline ratio
rests on: the baseline's per-iteration scheduler walks (the cost WavePP is exempt from) at
0, half and the measured constant, the host scale at 1.0 (not fitted), and this project's
cost-aware planner in place of MPU.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from prefill_node.core.planner import PlannerMode
from prefill_node.core.policy import Policy, trtllm_policy, wave_policy
from prefill_node.sim.presets import Preset, get_preset
from prefill_node.sim.sweep import Setting, default_requests, run_setting
from prefill_node.sim.workloads import WorkloadKind

WAVE, TRTLLM = "wave", "trtllm"  # the two policies of an absolute figure (row keys)
RATIO = "WavePP / TRT-LLM"
Where = tuple[WorkloadKind, int, int]  # workload, input length, concurrency


@dataclass(frozen=True)
class PaperFigure:
    """One setting the paper reports, with its two measured throughputs (input tok/s)."""

    preset: str
    kind: WorkloadKind
    input_len: int
    concurrency: int
    wave_tok_s: float
    trtllm_tok_s: float

    @property
    def ratio(self) -> float:
        return self.wave_tok_s / self.trtllm_tok_s


PAPER_FIGURES: tuple[PaperFigure, ...] = (
    PaperFigure("glm5-pp4", WorkloadKind.SUFFIX, 131_072, 128, 1_213_000, 416_000),
    PaperFigure("minimax-pp4", WorkloadKind.SUFFIX, 131_072, 128, 1_113_000, 551_000),
)


@dataclass(frozen=True)
class PaperRatio:
    """A relative figure of the paper's ablation: ``numerator`` / ``denominator`` throughput
    at one setting (policies built for P stages)."""

    figure: str
    kind: WorkloadKind
    input_len: int
    concurrency: int
    ratio: float
    numerator: Callable[[int], Policy]
    denominator: Callable[[int], Policy]


PAPER_RATIOS: tuple[PaperRatio, ...] = (
    PaperRatio(
        "wave admission (fixed M) / TRT-LLM",
        WorkloadKind.COLD,
        131_072,
        16,
        3.36,
        partial(wave_policy, planner_mode=PlannerMode.FIXED),
        trtllm_policy,
    ),
    PaperRatio(
        "MPU / fixed M",
        WorkloadKind.REUSE,
        262_144,
        32,
        0.903,
        partial(wave_policy, planner_mode=PlannerMode.MPU),
        partial(wave_policy, planner_mode=PlannerMode.FIXED),
    ),
)


@dataclass(frozen=True)
class FittedConstant:
    """A preset constant fitted on paper figures: ``fitted_on`` as (preset, WAVE or TRTLLM)."""

    name: str
    value: float
    fitted_on: tuple[tuple[str, str], ...]
    how: str


FITTED: tuple[FittedConstant, ...] = (
    FittedConstant(
        "host_time_scale",
        get_preset("glm5-pp4").host_time_scale,
        (("glm5-pp4", TRTLLM), ("minimax-pp4", TRTLLM)),
        "geometric mean of the two TRT-LLM PP4 rows = the paper's",
    ),
    FittedConstant(
        "glm5-pp4 flops_efficiency",
        get_preset("glm5-pp4").gpu.flops_efficiency,
        (("glm5-pp4", WAVE),),
        "GLM's WavePP row = the paper's",
    ),
)


def fitted_on(preset: str, *terms: str) -> tuple[FittedConstant, ...]:
    """The constants fitted on the figure made of ``terms`` (WAVE, TRTLLM) of ``preset``."""
    return tuple(c for c in FITTED if any((preset, t) in c.fitted_on for t in terms))


class Sample(enum.Enum):
    IN = "in-sample"  # a constant was fitted on the figure or on a term of it
    OUT = "out-of-sample"  # no constant was fitted on it
    ABLATION = "ablation"  # the simulator with one thing changed; no paper figure


@dataclass(frozen=True)
class FigureRow:
    """One figure: the paper's value (None: it gives none) beside the simulator's.
    Ratio figures carry the two throughputs they divide (``sim_num`` / ``sim_den``)."""

    sample: Sample
    preset: str
    kind: WorkloadKind
    input_len: int
    concurrency: int
    figure: str
    paper: float | None
    sim: float
    fitted: tuple[FittedConstant, ...] = ()
    change: str = ""  # an ablation: what differs from the preset
    sim_num: float | None = None
    sim_den: float | None = None

    @property
    def error(self) -> float | None:
        return None if self.paper is None else self.sim / self.paper - 1

    @property
    def is_ratio(self) -> bool:
        return self.sim_num is not None

    def row(self) -> dict[str, object]:
        return {
            "sample": self.sample.value,
            "preset": self.preset,
            "workload": self.kind.value,
            "input_len": self.input_len,
            "concurrency": self.concurrency,
            "figure": self.figure,
            "paper": self.paper,
            "sim": self.sim,
            "error": self.error,
            "fitted": bool(self.fitted),
            "fitted_on": "; ".join(f"{c.name} = {c.value:g} ({c.how})" for c in self.fitted),
            "change": self.change,
            "sim_numerator": self.sim_num,
            "sim_denominator": self.sim_den,
        }


def _throughput(preset: Preset, where: Where, policy: Policy, requests: int | None) -> float:
    kind, input_len, concurrency = where
    n = requests or default_requests(concurrency)
    setting = Setting(preset, kind, input_len, concurrency, n)
    return run_setting(setting, policy).throughput_tok_s


def headline(fig: PaperFigure, requests: int | None = None) -> list[FigureRow]:
    """The figure's three rows (WavePP, TRT-LLM, their ratio), then the ablations of its
    ratio: the scheduler walks at 0, half and as measured, host scale 1, our planner."""
    preset = get_preset(fig.preset)
    p, where = preset.num_stages, (fig.kind, fig.input_len, fig.concurrency)
    mpu = wave_policy(p, PlannerMode.MPU)

    def pair(variant: Preset) -> tuple[float, float]:
        wave = _throughput(variant, where, mpu, requests)
        return wave, _throughput(variant, where, trtllm_policy(p), requests)

    wave, lock = pair(preset)
    cost = _throughput(preset, where, wave_policy(p, PlannerMode.COST_AWARE), requests)
    measured = f"scheduler walks x1 (measured); host_time_scale {preset.host_time_scale:g}"
    return [
        _figure(fig, "WavePP tok/s", fig.wave_tok_s, wave, (WAVE,)),
        _figure(fig, "TRT-LLM PP4 tok/s", fig.trtllm_tok_s, lock, (TRTLLM,)),
        _figure(fig, RATIO, fig.ratio, wave / lock, (WAVE, TRTLLM), wave, lock),
        _ablation(fig, "scheduler walks x0", *pair(replace(preset, scheduler_walk_scale=0.0))),
        _ablation(fig, "scheduler walks x0.5", *pair(replace(preset, scheduler_walk_scale=0.5))),
        _ablation(fig, measured, wave, lock),
        _ablation(
            fig, "host_time_scale 1 (not fitted)", *pair(replace(preset, host_time_scale=1.0))
        ),
        _ablation(fig, "planner: cost-aware (ours) for MPU", cost, lock),
    ]


def _figure(
    fig: PaperFigure,
    label: str,
    paper: float,
    sim: float,
    terms: tuple[str, ...],
    num: float | None = None,
    den: float | None = None,
) -> FigureRow:
    """A paper figure's row, in-sample when a constant was fitted on one of its ``terms``."""
    fitted = fitted_on(fig.preset, *terms)
    sample = Sample.IN if fitted else Sample.OUT
    where = (fig.kind, fig.input_len, fig.concurrency)
    return FigureRow(sample, fig.preset, *where, label, paper, sim, fitted, "", num, den)


def _ablation(fig: PaperFigure, change: str, wave: float, lock: float) -> FigureRow:
    where = (fig.kind, fig.input_len, fig.concurrency)
    return FigureRow(
        Sample.ABLATION, fig.preset, *where, RATIO, fig.ratio, wave / lock, (), change, wave, lock
    )


def relative(fig: PaperRatio, preset_name: str, requests: int | None = None) -> FigureRow:
    """One relative figure of the paper on one preset (out-of-sample: nothing fitted on it)."""
    preset = get_preset(preset_name)
    where = (fig.kind, fig.input_len, fig.concurrency)
    p = preset.num_stages
    num = _throughput(preset, where, fig.numerator(p), requests)
    den = _throughput(preset, where, fig.denominator(p), requests)
    return FigureRow(
        Sample.OUT, preset_name, *where, fig.figure, fig.ratio, num / den, (), "", num, den
    )


def reproduce(requests: int | None = None) -> list[FigureRow]:
    """Every row: each absolute figure with its ablations, then each relative figure on
    each preset. ``requests`` per run (default: ``default_requests`` of the setting)."""
    rows = [r for fig in PAPER_FIGURES for r in headline(fig, requests)]
    for fig in PAPER_RATIOS:
        rows += [relative(fig, f.preset, requests) for f in PAPER_FIGURES]
    return rows
