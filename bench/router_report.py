"""What bench/router.py prints and plots: its tables (policies, overhead, core) and the PNG."""

from __future__ import annotations

from pathlib import Path

POLICIES = ("prefix", "fetch", "round-robin", "least-loaded", "prefix-only")
ORACLE = "oracle"
PATHS = ("direct", "router", "front", "proxy")
OVERHEAD_PROMPT = 128  # tokens: 7 blocks cached, the last block's 16 tokens computed

_ms = lambda v: f"{v * 1e3:.2f}"

POLICY_COLUMNS = (
    ("policy", "policy", str),
    ("input tok/s", "input_tok_s", "{:.0f}".format),
    ("computed tok", "computed_tokens", "{:.0f}".format),
    ("cached tok", "cached_tokens", "{:.0f}".format),
    ("cached", "cached_share", "{:.1%}".format),
    ("fetched", "fetched_share", "{:.1%}".format),
    ("p50 s", "p50_s", "{:.3f}".format),
    ("p95 s", "p95_s", "{:.3f}".format),
    ("busiest", "busiest_share", "{:.2f}".format),
    ("affinity", "tenant_affinity", "{:.2f}".format),
    ("spread", "tenant_spread", "{:.2f}".format),
    ("predicted / actual cached", "router_cached_prediction", "{:.3f}".format),
    ("router CPU ms/req", "router_cpu_ms_per_request", "{:.2f}".format),
)
OVERHEAD_COLUMNS = (
    ("c", "concurrency", str),
    ("direct p50 ms", "direct_p50_s", _ms),
    ("router p50 ms", "router_p50_s", _ms),
    ("front p50 ms", "front_p50_s", _ms),
    ("proxy p50 ms", "proxy_p50_s", _ms),
    ("router added ms", "router_added_s", _ms),
    ("front added ms", "front_added_s", _ms),
    ("proxy added ms", "proxy_added_s", _ms),
    ("pairs", "pairs", str),
    ("router / proxy added", "router_over_proxy_added", "{:.2f}".format),
    ("95% interval", "ratio_ci95_low", "{:.2f}".format),
    ("to", "ratio_ci95_high", "{:.2f}".format),
    ("stable", "stable", lambda ok: "yes" if ok else "NO: more pairs"),
    ("goal", "goal", str),
    ("met", "met", lambda met: "yes" if met else "MISSED"),
    ("router CPU ms/req", "router_cpu_ms_per_request", "{:.3f}".format),
    ("front CPU ms/req", "front_cpu_ms_per_request", "{:.3f}".format),
    ("proxy CPU ms/req", "proxy_cpu_ms_per_request", "{:.3f}".format),
)


def table(columns, rows: list[dict]) -> str:
    """A markdown table; "-" where a row lacks a column (the oracle's throughput)."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(f(r[k]) if k in r else "-" for _, k, f in columns) + " |")
    return "\n".join(lines)


def print_tables(summary: list[dict], core: list[dict], args) -> None:
    print(f"\n{args.tenants} tenants, {args.requests} requests, c = {args.concurrency}, "
          f"{args.num_blocks} blocks per stage (oracle: one pipeline, {2 * args.num_blocks}), "
          f"median of {args.runs} run(s)")  # fmt: skip
    print(table(POLICY_COLUMNS, [r for r in summary if r["policy"] in (*POLICIES, ORACLE)]))
    for r in summary:
        if r["policy"] == "ratio":
            goal = f"  (goal {r['goal']}: {'met' if r['met'] else 'MISSED'})" if "goal" in r else ""
            spread = f"{r['min']:.2f}-{r['max']:.2f} over {r['runs']} run(s)"
            print(f"{r['metric']}: {r['value']:.3f} ({spread}){goal}")
    overhead = [r for r in summary if r["policy"] == "overhead"]
    if overhead:
        print(f"\nrouter overhead, a cached {OVERHEAD_PROMPT}-token prompt on one pipeline")
        print(table(OVERHEAD_COLUMNS, overhead))
    print("\nrouter core (bench/router_core.py, CPU time)")
    for r in core:
        goal = f"  (goal {r['goal']}: {'met' if r['met'] else 'MISSED'})" if "goal" in r else ""
        print(f"{r['metric']}: {r['value']:,.3f} {r['unit']}{goal}")


def plot(rows: list[dict], summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = {r["policy"]: r for r in summary if r.get("run") == "median" and "path" not in r}
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.2))
    panels = (
        ("input_tok_s", "input tok/s", POLICIES),
        ("p95_s", "p95 latency (s)", POLICIES),
        ("cached_share", "cached share of input tokens", (*POLICIES, ORACLE)),
    )
    for ax, (key, label, policies) in zip(axes, panels, strict=False):
        shown = [p for p in policies if p in med]
        ax.bar(shown, [med[p][key] for p in shown], color="#9ab")
        for i, p in enumerate(shown):  # every run's own value
            runs = [r[key] for r in rows if r["policy"] == p]
            ax.plot([i] * len(runs), runs, "k.", alpha=0.6)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=20)
    axes[0].set_title("throughput (bars: median; dots: runs)")
    axes[1].set_title("p95 latency")
    axes[2].set_title("cache hits (oracle: one pipeline, 2x blocks)")
    overhead = [r for r in summary if r["policy"] == "overhead"]
    if not overhead:
        axes[3].set_visible(False)
    width = 0.8 / len(PATHS)
    for j, p in enumerate(PATHS):
        xs = [i + (j - (len(PATHS) - 1) / 2) * width for i in range(len(overhead))]
        axes[3].bar(xs, [r[f"{p}_p50_s"] * 1e3 for r in overhead], width, label=p)
    axes[3].set_xticks(range(len(overhead)), [f"c = {r['concurrency']}" for r in overhead])
    axes[3].set_ylabel("p50 latency (ms)")
    axes[3].set_title("router vs its front alone vs bare gRPC proxy, cached prompt")
    if overhead:
        axes[3].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- main -----------------------------------------------------------------------------------------
