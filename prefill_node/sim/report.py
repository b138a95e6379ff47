"""Side-by-side reporting of simulator runs: wave/baseline ratios, the printed table, the plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefill_node.sim.results import SimResult

BASELINES = ("trtllm", "sync-admission")  # what wave is compared with, preferred first
_Key = tuple[str, str, int, int]  # preset, workload, input_len, concurrency


def _key(r: SimResult) -> _Key:
    return (r.preset, r.workload, r.input_len, r.concurrency)


@dataclass(frozen=True)
class Comparison:
    """One setting run under wave and a baseline (``trtllm``, else the ``sync-admission``
    ablation): ``ratio`` = wave / baseline input throughput."""

    wave: SimResult
    baseline: SimResult

    @property
    def ratio(self) -> float:
        base = self.baseline.throughput_tok_s
        return self.wave.throughput_tok_s / base if base else float("inf")

    @property
    def p50_change(self) -> float:
        """Relative change of wave's p50 latency vs the baseline (negative = faster)."""
        base = self.baseline.p50_latency_s
        return self.wave.p50_latency_s / base - 1 if base else 0.0


def compare(results: Sequence[SimResult]) -> list[Comparison]:
    """Pair each wave run with the baseline run of the same setting (``trtllm`` before
    ``sync-admission``; the first wave run wins)."""
    baseline: dict[_Key, SimResult] = {}
    for name in reversed(BASELINES):
        baseline.update({_key(r): r for r in results if r.policy == name})
    out: list[Comparison] = []
    seen: set[_Key] = set()
    for r in results:
        k = _key(r)
        if r.policy not in BASELINES and k in baseline and k not in seen:
            seen.add(k)
            out.append(Comparison(r, baseline[k]))
    return out


def format_table(results: Sequence[SimResult]) -> str:
    """Plain-text table, one line per run, the wave/baseline ratio on each wave line."""
    ratios = {(_key(c.wave), c.wave.policy): c.ratio for c in compare(results)}
    head = (
        f"{'preset':<12} {'workload':<9} {'input':>7} {'conc':>4} {'policy':<16} "
        f"{'tok/s':>12} {'p50 s':>8} {'p95 s':>8} {'cached':>6} {'util':>5} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = ratios.get((_key(r), r.policy))
        lines.append(
            f"{r.preset:<12} {r.workload:<9} {r.input_len:>7} {r.concurrency:>4} "
            f"{r.policy:<16} {r.throughput_tok_s:>12,.0f} {r.p50_latency_s:>8.3f} "
            f"{r.p95_latency_s:>8.3f} {r.cached_fraction:>6.2f} {r.stage_utilisation:>5.2f} "
            f"{'' if ratio is None else f'{ratio:.2f}x':>6}"
        )
    return "\n".join(lines)


def regressions(results: Sequence[SimResult], tolerance: float = 0.03) -> list[Comparison]:
    """Settings where wave's throughput is more than ``tolerance`` below the baseline's."""
    return [c for c in compare(results) if c.ratio < 1 - tolerance]


def plot(results: Sequence[SimResult], path: str) -> None:
    """PNG: input throughput vs concurrency, one panel per (preset, workload), one line per
    (policy, input length): one colour per length, wave solid, the baselines dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.preset, r.workload) for r in results})
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (preset, workload) in zip(axes.flat, panels, strict=False):
        series: dict[tuple[str, int], list[SimResult]] = {}
        for r in results:
            if (r.preset, r.workload) == (preset, workload):
                series.setdefault((r.policy, r.input_len), []).append(r)
        lengths = sorted({n for _, n in series})
        for (policy, input_len), runs in sorted(series.items()):
            runs.sort(key=lambda r: r.concurrency)
            ax.plot(
                [r.concurrency for r in runs],
                [r.throughput_tok_s / 1e3 for r in runs],
                linestyle="--" if policy in BASELINES else "-",
                color=f"C{lengths.index(input_len)}",
                marker="o",
                markersize=3,
                label=f"{policy} {input_len // 1024}K",
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{preset} / {workload}", fontsize=9)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("input K tok/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
