"""The printed form of ``wavepp sim --reproduce-paper``: in-sample, out-of-sample, ablations."""

from __future__ import annotations

from prefill_node.sim.paper import FITTED, FigureRow, Sample

_HEAD = f"{'preset':<12} {'setting':<20} {'figure':<36} {'paper':>10} {'sim':>10} {'error':>7}"


def _setting(r: FigureRow) -> str:
    return f"{r.kind.value} {r.input_len // 1024}K c={r.concurrency}"


def _value(r: FigureRow, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if r.is_ratio else f"{value:,.0f}"


def _line(r: FigureRow) -> str:
    marks = "".join(f"[{chr(97 + FITTED.index(c))}]" for c in r.fitted)
    error = "" if r.error is None else f"{r.error:+.1%}"
    return (
        f"{r.preset:<12} {_setting(r):<20} {r.figure:<36} {_value(r, r.paper):>10} "
        f"{_value(r, r.sim):>10} {error:>7} {marks}"
    ).rstrip()


def _ablations(rows: list[FigureRow]) -> list[str]:
    head = (
        f"{'preset':<12} {'change':<52} {'WavePP tok/s':>12} {'TRT-LLM tok/s':>13} "
        f"{'ratio':>6} {'vs paper':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.preset:<12} {r.change:<52} {r.sim_num:>12,.0f} {r.sim_den:>13,.0f} "
            f"{r.sim:>5.2f}x {r.error:>+8.1%}"
        )
    return lines


def headline(rows: list[FigureRow]) -> list[str]:
    """The result: every ratio's error (simulated vs paper), in-sample and out-of-sample."""
    lines = ["RESULT: the ratios' errors, simulated / paper - 1"]
    for sample in (Sample.IN, Sample.OUT):
        ratios = [r for r in rows if r.sample is sample and r.is_ratio and r.error is not None]
        if ratios:
            mean = sum(abs(r.error) for r in ratios) / len(ratios)
            lines.append(f"  {sample.value}, mean |error| {mean:.0%}:")
            lines += [
                f"    {r.preset:<12} {_setting(r):<20} {r.figure:<36} {r.error:+.1%}"
                for r in ratios
            ]
    return lines


def format_table(rows: list[FigureRow]) -> str:
    lines = ["WavePP paper (arXiv 2609.35263, figures from secondary summaries) vs wavepp sim"]
    for sample, title in (
        (Sample.IN, "IN-SAMPLE: a constant was fitted on the figure or on a term of it"),
        (Sample.OUT, "OUT-OF-SAMPLE: no constant was fitted on these (predictions)"),
    ):
        lines += ["", title, _HEAD, "-" * len(_HEAD)]
        lines += [_line(r) for r in rows if r.sample is sample]
    lines.append("fitted: " + "; ".join(
        f"[{chr(97 + i)}] {c.name} = {c.value:g} ({c.how})" for i, c in enumerate(FITTED)
    ))  # fmt: skip
    ablations = [r for r in rows if r.sample is Sample.ABLATION]
    if ablations:
        first = ablations[0]
        lines += [
            "",
            f"ABLATIONS of the ratio WavePP (mpu) / TRT-LLM PP4 at {_setting(first)}; "
            "'vs paper': against the paper's ratio",
            *_ablations(ablations),
        ]
    lines += ["", *headline(rows)]
    return "\n".join(lines)
