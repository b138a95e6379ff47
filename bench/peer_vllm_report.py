"""bench/peer_vllm.py's report: per-run rows -> medians and ours/vLLM ratios, the table, the plot.

Row kinds (all flat, all with ``system``, ``dtype``, ``case``, ``run``):
- ``run``: one system on one case in one run (``input_tok_s``, ``computed_tok_s``, tokens);
- ``median``: the median of a (system, dtype, case) over its runs (``run`` = "median");
- ``ratio``: one of our systems over one vLLM mode on a (dtype, case): the median over runs of
  each run's own ratio (paired: both sides measured in the same run), for input and computed
  tok/s, and how many runs ours was ahead on input tok/s. The headline (``headline``) is
  against vLLM's default configuration, ``vllm-compiled``; ``vllm-eager`` stands beside it.

First-token agreement is part of every row and required: each ``run`` row says which share
of its prompts got the same greedy first token as each vLLM mode in the same run
(``agreement_vllm_compiled`` / ``_eager``; ``first_token_agreement`` against the headline
peer, else eager), a ratio row the lowest of its pairs, and ``agreement_problems`` lists the
rows below ``MIN_AGREEMENT`` or without any vLLM row to compare with; the bench fails on
any. Two engines' float sums differ, so where both rows carry each prompt's top-2 (token,
logprob) pairs (``first_top``), a different first token still agrees when it is a near-tie:
each engine ranks the other's token within ``TIE_NATS[dtype]`` of its own first choice
(``first_token_near_ties`` counts those against the headline peer). A token outside the
other's top 2, or a clear margin, is a disagreement.
"""

from __future__ import annotations

import statistics
from pathlib import Path

OURS = ("wavepp-pipeline", "wavepp-router")
PEERS = ("vllm-compiled", "vllm-eager")  # vLLM's default (the headline) first
HEADLINE_PEER = PEERS[0]
SYSTEMS = OURS + PEERS
METRICS = ("input_tok_s", "computed_tok_s")
MIN_AGREEMENT = 0.9
# A near-tie is a gap of a few rounding steps of the logits in that dtype: bfloat16 keeps 8
# significant bits, so a logit near 30 moves in steps of 0.125 (two steps: 0.25 nats);
# float32's sums differ between kernels by far less than 0.01.
TIE_NATS = {"float32": 0.01, "bfloat16": 0.25}


def rates(prompt_tokens: int, cached_tokens: int, wall_s: float) -> dict:
    """A measurement's row fields from its token counts and wall time."""
    computed = prompt_tokens - cached_tokens
    return {"input_tok_s": prompt_tokens / wall_s, "computed_tok_s": computed / wall_s,
            "input_tokens": prompt_tokens, "computed_tokens": computed,
            "cached_tokens": cached_tokens, "cached_share": cached_tokens / prompt_tokens,
            "wall_s": wall_s}  # fmt: skip


def summarise(per_run: list[dict]) -> list[dict]:
    """The ``median`` rows, then the ``ratio`` rows, of the ``run`` rows ``per_run`` (dtypes and
    cases in the order they first appear there)."""
    cells: dict[tuple[str, str, str], list[dict]] = {}
    for r in per_run:
        cells.setdefault((r["system"], r["dtype"], r["case"]), []).append(r)
    medians = []
    for (system, dtype, case), runs in cells.items():
        row = {"kind": "median", "system": system, "dtype": dtype, "case": case,
               "run": "median", "runs": len(runs)}  # fmt: skip
        for key in ("input_tok_s", "computed_tok_s", "cached_share", "wall_s"):
            row[key] = statistics.median(r[key] for r in runs)
        agreed = [r["first_token_agreement"] for r in runs if r.get("first_token_agreement")]
        row["first_token_agreement"] = statistics.median(agreed) if agreed else None
        medians.append(row)
    ratios = []
    for (system, dtype, case), runs in cells.items():
        if system not in OURS:
            continue
        for peer in PEERS:
            theirs = {r["run"]: r for r in cells.get((peer, dtype, case), [])}
            pairs = [(r, theirs[r["run"]]) for r in runs if r["run"] in theirs]
            if not pairs:
                continue
            ahead = sum(a["input_tok_s"] > b["input_tok_s"] for a, b in pairs)
            agreed = [a.get(_agreement(peer)) for a, _ in pairs]
            lowest = None if None in agreed else min(agreed)
            row = {"kind": "ratio", "system": system, "peer": peer, "dtype": dtype,
                   "case": case, "run": "median", "paired_runs": len(pairs),
                   "ahead_runs": ahead, "headline": peer == HEADLINE_PEER,
                   "first_token_agreement": lowest,
                   "agreement_ok": lowest is not None and lowest >= MIN_AGREEMENT}  # fmt: skip
            for key in METRICS:
                row[key] = statistics.median(a[key] / b[key] for a, b in pairs)
            ratios.append(row)
    order = {s: i for i, s in enumerate(SYSTEMS)}
    dtypes = {d: i for i, d in enumerate(dict.fromkeys(r["dtype"] for r in per_run))}
    cases = {c: i for i, c in enumerate(dict.fromkeys(r["case"] for r in per_run))}
    key = lambda r: (dtypes[r["dtype"]], cases[r["case"]], order.get(r["system"], 99),
                     r.get("peer", ""))  # fmt: skip
    return sorted(medians, key=key) + sorted(ratios, key=key)


def _agreement(peer: str) -> str:
    """The row key of the first-token agreement with ``peer`` (``agreement_vllm_eager``)."""
    return "agreement_" + peer.replace("-", "_")


def same_first_token(a: list, b: list, tol: float) -> tuple[bool, bool]:
    """(agree, near_tie) for one prompt: ``a`` and ``b`` are each engine's top (token,
    logprob) pairs, best first (one pair with logprob None where only the token is known:
    then only equal tokens agree)."""
    if a[0][0] == b[0][0]:
        return True, False
    la, lb = dict(map(tuple, a)), dict(map(tuple, b))
    if a[0][1] is None or b[0][1] is None or b[0][0] not in la or a[0][0] not in lb:
        return False, False
    tie = a[0][1] - la[b[0][0]] <= tol and b[0][1] - lb[a[0][0]] <= tol
    return tie, tie


def _tops(row: dict) -> list[list]:
    """Each prompt's top (token, logprob) pairs, or its first token alone."""
    return row.get("first_top") or [[(t, None)] for t in row["first_tokens"]]


def first_token_agreement(per_run: list[dict]) -> list[str]:
    """Add to every ``run`` row, for each vLLM mode, the share of its prompts whose greedy
    first token agrees with that mode's on the same (dtype, case, run) (``same_first_token``;
    ``_agreement(peer)``; None when that mode has no such row), and
    ``first_token_agreement``: against the headline peer, else eager - a check that both ran
    the same model on the same prompts. Returns the problems: rows below ``MIN_AGREEMENT``,
    or with nothing to compare with while a vLLM mode ran."""
    problems = []
    any_peer = any(r["system"] in PEERS for r in per_run)
    ties: dict[tuple[int, str], int] = {}
    for peer in PEERS:
        ref = {(r["dtype"], r["case"], r["run"]): _tops(r) for r in per_run
               if r["system"] == peer}  # fmt: skip
        for r in per_run:
            theirs, ours = ref.get((r["dtype"], r["case"], r["run"])), _tops(r)
            value = None
            if theirs is not None and len(theirs) == len(ours):
                tol = TIE_NATS.get(r["dtype"], 0.0)
                seen = [same_first_token(a, b, tol) for a, b in zip(ours, theirs, strict=True)]
                value = sum(agree for agree, _ in seen) / len(seen)
                ties[(id(r), peer)] = sum(tie for _, tie in seen)
            r[_agreement(peer)] = value
    for r in per_run:
        found = [p for p in PEERS if r[_agreement(p)] is not None]
        r["first_token_agreement"] = r[_agreement(found[0])] if found else None
        r["first_token_near_ties"] = ties[(id(r), found[0])] if found else None
        where = f"{r['system']} {r['dtype']} {r['case']} run {r['run']}"
        lowest = min((r[_agreement(p)] for p in found), default=None)
        if any_peer and not found:
            problems.append(f"{where}: no vLLM row to compare first tokens with")
        elif lowest is not None and lowest < MIN_AGREEMENT:
            problems.append(f"{where}: first tokens agree on {lowest:.0%} < {MIN_AGREEMENT:.0%}")
    return problems


def table(summary: list[dict]) -> str:
    """Markdown: a line per (dtype, case): every system's median input tok/s (computed tok/s
    in brackets where it differs) and ours over each vLLM mode (input tok/s)."""
    med = {(r["system"], r["dtype"], r["case"]): r for r in summary if r["kind"] == "median"}
    rat = {(r["system"], r["peer"], r["dtype"], r["case"]): r for r in summary
           if r["kind"] == "ratio"}  # fmt: skip
    systems = [s for s in SYSTEMS if any(k[0] == s for k in med)]
    pairs = [(o, p) for o in OURS for p in PEERS if any(k[:2] == (o, p) for k in rat)]
    head = ["dtype", "case", *systems, *(f"{o.split('-')[1]}/{p.split('-')[1]}" for o, p in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype, case in dict.fromkeys((k[1], k[2]) for k in med):
        cells = [dtype, case]
        for s in systems:
            r = med.get((s, dtype, case))
            if r is None:
                cells.append("-")
            elif r["cached_share"] > 0.001:
                cells.append(f"{r['input_tok_s']:,.0f} ({r['computed_tok_s']:,.0f})")
            else:
                cells.append(f"{r['input_tok_s']:,.0f}")
        for o, p in pairs:
            r = rat.get((o, p, dtype, case))
            cells.append(f"{r['input_tok_s']:.2f}x" if r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    """One panel per dtype: median input tok/s per case, a bar per system (log scale: cached
    cases run 10x faster), ours/best-vLLM ratio over our bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = [r for r in summary if r["kind"] == "median"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in med))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        rows = {(r["system"], r["case"]): r for r in med if r["dtype"] == dtype}
        cases = list(dict.fromkeys(c for _, c in rows))
        systems = [s for s in SYSTEMS if any(k[0] == s for k in rows)]
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            xs = [j + i * width for j, c in enumerate(cases) if (system, c) in rows]
            ys = [rows[(system, c)]["input_tok_s"] for c in cases if (system, c) in rows]
            ax.bar(xs, ys, width, label=system)
            if system not in OURS:
                continue
            for x, c, y in zip(xs, [c for c in cases if (system, c) in rows], ys, strict=True):
                peers = [rows[(p, c)]["input_tok_s"] for p in PEERS if (p, c) in rows]
                if peers:
                    ax.text(x, y, f"{y / max(peers):.2f}x", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases)
        ax.set_yscale("log")
        ax.set_ylabel("input tok/s (median)")
        ax.set_title(f"{dtype}: ours vs vLLM (label: ours / best vLLM)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
