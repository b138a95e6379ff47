"""`wavepp sim --cluster N ...`: routing policies on N simulated pipelines, table, JSON, plot.

The workload (``cluster_workload``) is sized from the preset so that routing matters: the
tenants' system prompts together fill ``working_set`` times one pipeline's cache (a round
robin cannot keep them all; partitioning tenants across pipelines can), and the popularity
ranking rotates by an eighth of the tenants every quarter of the run. Then a Zipf sweep
finds where prefix-aware routing stops paying: as one tenant's share of the traffic grows,
keeping its prefix on one pipeline loads that pipeline more than the cache saves.

The ``fetch`` policy (a pipeline may copy a prefix from another pipeline that holds it,
``cluster_sim.py``) is measured against the pooled-cache ``oracle``: ``fetch_gains`` says
what share of the oracle's gain over round-robin it reaches at each N.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, fields, replace

from tqdm import tqdm

from prefill_node.sim.presets import Preset, get_preset
from prefill_node.sim.roofline import PipelineRoofline
from prefill_node.sim.tenants import TenantWorkload
from prefill_router.cluster_sim import ClusterPolicy, ClusterResult, ClusterSim, ClusterSpec

SYSTEM_TOKENS = (16_384, 49_152)  # a tenant's shared prefix (documents, agent context)
SUFFIX_TOKENS = (1_024, 4_096)  # each request's own part
ZIPF_SWEEP = (0.6, 1.0, 1.4, 1.8, 2.2)


def cluster_spec(
    preset: Preset,
    num_pipelines: int,
    *,
    zipf: float = 1.0,
    working_set: float = 3.0,
    requests_per_pipeline: int = 100,
    clients_per_pipeline: int = 16,
    seed: int = 0,
) -> ClusterSpec:
    """The default cluster run for ``preset`` (see the module docstring)."""
    base = ClusterSpec(preset, num_pipelines, _placeholder(), clients=1)
    scale, block = base.token_scale, base.block_tokens
    roof = PipelineRoofline(preset.model, preset.gpu, preset.link, preset.num_stages, block)
    cache_tokens = min(s.capacity_blocks for s in roof.stages) * block
    mean_system = sum(SYSTEM_TOKENS) / 2
    requests = requests_per_pipeline * num_pipelines
    tenants = max(2, round(working_set * cache_tokens / mean_system))
    workload = TenantWorkload(
        tenants=tenants,
        requests=requests,
        zipf=zipf,
        system_tokens=(SYSTEM_TOKENS[0] // scale, SYSTEM_TOKENS[1] // scale),
        suffix_tokens=(SUFFIX_TOKENS[0] // scale, SUFFIX_TOKENS[1] // scale),
        vocab=50_000,
        seed=seed,
        shift_every=max(1, requests // 4),
        shift_by=max(1, tenants // 8),
    )
    return replace(
        base, workload=workload, clients=clients_per_pipeline * num_pipelines, warmup=requests // 4
    )


def _placeholder() -> TenantWorkload:
    return TenantWorkload(1, 1, 1.0, (1, 1), (1, 1), 2)


def run_policies(spec: ClusterSpec, bar: tqdm | None = None) -> list[ClusterResult]:
    out = []
    for policy in ClusterPolicy:
        out.append(ClusterSim(spec, policy).run())
        if bar is not None:
            bar.update()
    return out


def medians(rows: list[ClusterResult]) -> list[ClusterResult]:
    """One row per (preset, N, Zipf exponent, policy): each figure the median over the
    seeds that ran it (in first-seen order; ``seed`` is the number of seeds)."""
    groups: dict[tuple, list[ClusterResult]] = {}
    for r in rows:
        groups.setdefault((r.preset, r.pipelines, r.zipf, r.policy), []).append(r)
    keep = {"preset", "pipelines", "policy", "zipf", "tenants", "clients"}
    out = []
    for group in groups.values():
        values = {
            f.name: getattr(group[0], f.name)
            if f.name in keep
            else statistics.median(getattr(r, f.name) for r in group)
            for f in fields(ClusterResult)
        }
        values["seed"] = len(group)
        out.append(ClusterResult(**values))
    return out


def format_table(rows: list[ClusterResult]) -> str:
    head = (
        f"{'preset':<12} {'N':>3} {'zipf':>4} {'policy':<13} {'input tok/s':>13} {'vs rr':>6} "
        f"{'cached':>6} {'fetched':>7} {'p50 s':>7} {'p95 s':>7} {'busiest':>7}"
    )
    lines = [head, "-" * len(head)]
    rr = {(r.preset, r.pipelines, r.zipf): r.input_tok_s for r in rows if r.policy == "round_robin"}
    for r in rows:
        base = rr.get((r.preset, r.pipelines, r.zipf))
        vs = f"{r.input_tok_s / base:.2f}x" if base else "-"
        lines.append(
            f"{r.preset:<12} {r.pipelines:>3} {r.zipf:>4.1f} {r.policy:<13} "
            f"{r.input_tok_s:>13,.0f} {vs:>6} {r.cached_share:>6.2f} {r.fetched_share:>7.2f} "
            f"{r.p50_s:>7.2f} {r.p95_s:>7.2f} {r.busiest_share:>7.2f}"
        )
    return "\n".join(lines)


def fetch_gains(rows: list[ClusterResult]) -> list[str]:
    """Per (preset, N, Zipf exponent) with fetch, oracle and round-robin rows: the share of
    the oracle's gain over round-robin that fetch reaches, fetch against the prefix policy,
    and the copies' size and time against the recompute they replaced."""
    out = []
    by = {(r.preset, r.pipelines, r.zipf, r.policy): r for r in rows}
    for preset, n, zipf, policy in by:
        if policy != "fetch":
            continue
        key = (preset, n, zipf)
        rr, oracle, prefix = (by.get((*key, p)) for p in ("round_robin", "oracle", "prefix"))
        if rr is None or oracle is None or rr.input_tok_s <= 0:
            continue
        f = by[(*key, "fetch")]
        gain, best = f.input_tok_s / rr.input_tok_s - 1, oracle.input_tok_s / rr.input_tok_s - 1
        share = f"{gain / best:.2f}" if best > 0 else "-"
        vs_prefix = f"{f.input_tok_s / prefix.input_tok_s:.2f}x" if prefix else "-"
        out.append(
            f"{preset} N={n} zipf {zipf}: fetch {1 + gain:.2f}x round-robin, oracle "
            f"{1 + best:.2f}x (fetch reaches {share} of the oracle's gain), fetch / prefix "
            f"{vs_prefix}; {f.fetch_gb_per_request:.2f} GB copied per request, "
            f"{f.fetch_mean_s * 1e3:.0f} ms per copy against {f.recompute_mean_s * 1e3:.0f} ms "
            f"of recompute replaced"
        )
    return out


def stops_paying(rows: list[ClusterResult], margin: float = 0.05) -> list[str]:
    """Per (preset, N): the lowest Zipf exponent of the sweep at which PREFIX is no more than
    ``margin`` ahead of LEAST_LOADED, and the lowest at which PREFIX_ONLY falls behind it."""
    out = []
    groups = sorted({(r.preset, r.pipelines) for r in rows})
    for preset, n in groups:
        by = {
            (r.zipf, r.policy): r.input_tok_s
            for r in rows
            if (r.preset, r.pipelines) == (preset, n)
        }
        zipfs = sorted({z for z, _ in by})
        if len(zipfs) < 2:
            continue
        gain = {z: by[z, "prefix"] / by[z, "least_loaded"] for z in zipfs}
        only = {z: by[z, "prefix_only"] / by[z, "least_loaded"] for z in zipfs}
        prefix_end = next((z for z in zipfs if gain[z] <= 1 + margin), None)
        only_end = next((z for z in zipfs if only[z] < 1), None)
        curve = ", ".join(f"{z:.1f}: {gain[z]:.2f}x / {only[z]:.2f}x" for z in zipfs)
        never = f"at no Zipf exponent up to {zipfs[-1]}"
        out.append(
            f"{preset} N={n}: prefix / least-loaded and prefix-only / least-loaded by Zipf "
            f"exponent: {curve}. Prefix-aware routing within {margin:.0%} of least-loaded "
            f"{never if prefix_end is None else f'from zipf {prefix_end}'}; prefix-only "
            f"behind least-loaded {never if only_end is None else f'from zipf {only_end}'}."
        )
    return out


def plot(rows: list[ClusterResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.preset, r.pipelines) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.6 * len(groups), 3.6), squeeze=False)
    for ax, (preset, n) in zip(axes.flat, groups, strict=True):
        mine = [r for r in rows if (r.preset, r.pipelines) == (preset, n)]
        for i, policy in enumerate(ClusterPolicy):
            pts = sorted((r.zipf, r.input_tok_s / 1e6) for r in mine if r.policy == policy.value)
            ax.plot(*zip(*pts, strict=True), marker="o", color=f"C{i}", label=policy.value)
        ax.set_title(f"{preset}, {n} pipelines", fontsize=9)
        ax.set_xlabel("Zipf exponent of tenant popularity")
        ax.set_ylabel("cluster input M tok/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_cluster(args: argparse.Namespace) -> int:
    """Every policy at the default Zipf exponent for each N (``--cluster 8 32``), then the
    Zipf sweep at the first N; ``--preset`` (default: both PP4 presets)."""
    names = args.preset or ["glm5-pp4", "minimax-pp4"]
    sizes = args.cluster
    if any(n < 1 for n in sizes):
        print("wavepp sim: error: --cluster needs N >= 1", flush=True)
        return 2
    seeds = range(args.seed, args.seed + max(1, args.cluster_seeds))
    specs = []
    for seed in seeds:
        for name in names:
            preset = get_preset(name)
            specs += [cluster_spec(preset, n, seed=seed) for n in sizes]
            specs += [
                cluster_spec(preset, sizes[0], zipf=z, seed=seed) for z in ZIPF_SWEEP if z != 1.0
            ]
    rows: list[ClusterResult] = []
    with tqdm(total=len(specs) * len(ClusterPolicy), desc="cluster", unit="run") as bar:
        for spec in specs:
            rows += run_policies(spec, bar)
    table = medians(rows) if len(seeds) > 1 else rows
    if len(seeds) > 1:
        print(f"medians over {len(seeds)} workload seeds ({seeds[0]}-{seeds[-1]})")
    print(format_table(table))
    for line in stops_paying(table) + fetch_gains(table):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    if args.plot:
        plot([r for r in table if r.pipelines == sizes[0]], args.plot)
    return 0
