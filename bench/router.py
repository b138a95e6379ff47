"""Benchmark: the cluster router on a real local cluster - the routing policies side by side,
the router's added latency against a bare gRPC proxy, and its sans-IO core.

CLUSTER: two pipelines (`wavepp serve --stages 2`, one torch thread per stage process, every
stage with its NIXL agent) of a tiny random Llama (hidden 384, 4 layers, vocab 512; saved to
a temp dir) behind one `wavepp router --policy P`. The fetch policy is prefix plus the option
to send a request to a pipeline that first copies the prefix from the other one (each stage
READs its layers from the other's stage over NIXL on loopback), when the router's cost and
transfer models say that finishes sooner. Each pipeline runs on its own half of the
machine's cores (taskset;
one core each on 2 cores), as if on its own host: a busy pipeline cannot borrow the other's
core, so balance matters as in a real cluster; the router and the client use every core.
Every policy gets a FRESH cluster (pipelines and router started anew, the same warm-up under a
salt no request uses): each starts cold and meets no block another policy left, which four
routers side by side on shared pipelines could not give; so the policies run one after
another, the order reversing run by run. Stages hold --num-blocks blocks each: by default half
of all tenants' system-prompt blocks plus the suffixes of c/2 requests in flight, so the two
caches together hold the system prompts about once - no room for every tenant on both
pipelines (what round-robin needs): placement decides what stays cached.

WORKLOAD (prefill_node/sim/tenants.py, shared with `wavepp sim --cluster`; the same seeded
sequence for every policy of a run, a new one each run): T tenants, each with its own system
prompt (512-1024 tokens) and cache_salt; a request picks a tenant by Zipf popularity (s =
1.1 over the tenants' ranks) and appends a unique 32-128-token suffix; a closed loop at
concurrency c from one asyncio gRPC client.
Reported per policy and run: input tok/s over the wall time, computed and cached tokens,
p50 / p95 latency, the busiest pipeline's share of requests, tenant affinity (the share of
requests served on their tenant's most used pipeline) and spread (pipelines per tenant), the
router's predicted vs reported cached tokens and decisions by reason (from its /metrics) and
its CPU time per request; for fetch, the fetched share of input tokens (copied, then
reused) and the mean time a copy took on the pipeline. Ratios, paired by run (median over
runs): prefix_over_<policy> (input tok/s) and prefix_cached_over_<policy> (cached tokens);
fetch_over_prefix (input tok/s, goal >= 1.1) and fetch_cached_over_oracle (cached tokens,
goal >= 0.95).

ORACLE: the same requests at the same concurrency on ONE pipeline (same stages, every core)
whose stages hold the cluster's total blocks (2 x --num-blocks), driven directly: one LRU
cache of the cluster's size that never duplicates a prefix. Only its token counts are
reported (one pipeline: its throughput is not comparable). Goal: prefix_cached_over_oracle
>= 0.9.

OVERHEAD: one pipeline (every core), a router in front of it alone (prefix), a bare
grpc.aio pass-through proxy (a generic handler forwarding PrefillService/Prefill as bytes, in
a child process) and the FRONT: the router's own gRPC server (servicer, validation,
health, metrics) forwarding every request unrouted (a child process) - so the router's hop
splits into front (front - proxy) and routing (router - front); the same cached 128-token
prompt (112 tokens cached, 16 computed) at c = 1 and 32, in PAIRS: each request through a
hop is sent back to back with one direct, the pair's order alternating and the hops' order
rotating, so no order flatters either path. added = the median over pairs of (hop -
direct); router / proxy added comes with a 95% bootstrap interval over the pairs and counts
as a result only when that interval is within 20% of it (else: more pairs). The second
figure is each hop's CPU time per request (its process, only its own requests); goal
router_added / proxy_added <= 1.2 (met: stable and the interval's top <= 1.2). Every row
carries its provenance (bench/provenance.py).

CORE: bench/router_core.py's functions (CPU time; before any cluster starts): a routing
decision for a 32K-token prompt over 4 pipelines (goal <= 2 ms) and KV-event ingestion (goal
>= 500K blocks/s).

    .venv/bin/python bench/router.py --json out/router.json      # full run: ~15 min on 2 cores
    .venv/bin/python bench/router.py --json /tmp/router.json --runs 1 --requests 40 --tenants 4

Writes every row (per run, then medians, ratios, overhead, core) to PATH - rewritten after
each measurement, so an interrupted run keeps what it measured - and a plot beside it (.png).
Every process it starts runs in its own session and is stopped on the way out (SIGTERM, then
SIGKILL to the session), on errors, SIGTERM and Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance
from router_cluster import (  # bench/ is on sys.path: this file runs as a script
    BLOCK,
    MODEL_HF,
    VOCAB,
    Cluster,
    pipeline_cpus,
    router_counters,
    warm_pipeline,
    warm_router,
)
from router_report import (  # bench/ is on sys.path: this file runs as a script
    ORACLE,
    OVERHEAD_PROMPT,
    PATHS,
    POLICIES,
    plot,
    print_tables,
)
from router_workload import (  # bench/ is on sys.path: this file runs as a script
    closed_loop,
    default_num_blocks,
    latency_stats,
    placement_stats,
    run_closed_loop,
    token_stats,
)
from tqdm import tqdm

from prefill_node.sim.tenants import TenantRequest, TenantWorkload

CORE_BLOCKS, CORE_RESIDENT, CORE_REPEATS = 500_000, 200_000, 20  # bench/router_core.py's


def measure_policy(policy, requests, args, model_dir, logs, tag, inner: tqdm) -> dict:
    """One closed loop of ``requests`` on a fresh cluster behind a ``policy`` router, or on
    the oracle's lone pipeline."""
    from prefill_node.process_tree import ProcessTree

    with Cluster(model_dir, logs, args) as cluster:
        if policy == ORACLE:
            pipeline = cluster.serve(ORACLE, 2 * args.num_blocks, kv_agents=True)
            pipeline.wait_listening()
            warm_pipeline(pipeline.address, args.warm_tokens)
            outcomes, _ = run_closed_loop(pipeline.address, requests, args.concurrency, tag, inner)
            return {"requests": len(outcomes), **token_stats(outcomes)}
        pipelines = [
            cluster.serve(
                f"p{i}",
                args.num_blocks,
                None if args.shared_cores else pipeline_cpus(i, 2),
                kv_agents=True,  # every policy on the same pipelines; fetch needs them
            )
            for i in range(2)
        ]
        for p in pipelines:
            warm_pipeline(p.wait_listening().address, args.warm_tokens)
        router = cluster.router(policy, pipelines)
        warm_router(router.address, len(pipelines))
        before, cpu0 = router_counters(router.metrics_port), ProcessTree(router.pid).cpu_s()
        outcomes, wall = run_closed_loop(router.address, requests, args.concurrency, tag, inner)
        router_cpu = ProcessTree(router.pid).cpu_s() - cpu0
        counters = router_counters(router.metrics_port) - before  # the warm-up's left out
    predicted, actual = (
        counters["router_predicted_cached_tokens"],
        counters["router_actual_cached_tokens"],
    )
    return {
        **latency_stats(outcomes, wall),
        **token_stats(outcomes, wall),
        **placement_stats(outcomes),
        "router_cpu_ms_per_request": router_cpu / len(outcomes) * 1e3,
        "router_cached_prediction": predicted / actual if actual else None,
        **{key: counters[key] for key in sorted(counters)},
    }


def measure_overhead(args, model_dir, logs, bar: tqdm, inner: tqdm) -> list[dict]:
    """p50 of a cached prompt direct / through the router / through the bare proxy, and the
    CPU time per request of the hop (the router's or the proxy's process)."""
    if not args.overhead_concurrency:
        return []
    from prefill_node.process_tree import ProcessTree

    rng = random.Random(f"{args.seed}-overhead")
    prompt = TenantRequest(
        -1, "overhead", tuple(rng.randrange(VOCAB) for _ in range(OVERHEAD_PROMPT))
    )
    with Cluster(model_dir, logs, args) as cluster:
        pipeline = cluster.serve("p0", args.num_blocks).wait_listening()
        warm_pipeline(pipeline.address, args.warm_tokens)
        router = cluster.router("prefix", [pipeline])
        warm_router(router.address, 1)
        proxy = cluster.proxy(pipeline.address)
        front = cluster.proxy(pipeline.address, front=True)
        hops = {"router": router, "front": front, "proxy": proxy}
        targets = {"direct": pipeline.address} | {path: h.address for path, h in hops.items()}
        hops = {"direct": None} | {path: ProcessTree(h.pid) for path, h in hops.items()}
        return asyncio.run(_overhead_runs(args, prompt, targets, hops, bar, inner))


async def _overhead_runs(args, prompt, targets, hops, bar, inner) -> list[dict]:
    """Paired requests. In each (run, c) cell, c workers each send rounds of the cached
    prompt: one PAIR per hop per round, the prompt through the hop and direct, back to back.
    Within a pair the order alternates round by round (and worker by worker) and the hops'
    order rotates, so neither side always goes first, follows a given hop, or meets the
    same neighbours. A hop's added latency is the median over its pairs of (hop - direct);
    its CPU per request is its process's CPU time over the cell / the requests it served
    (only its own pairs reach it)."""
    from prefill_node.client.prefill_client import AsyncPrefillClient

    clients = {path: AsyncPrefillClient(target) for path, target in targets.items()}
    hop_paths = PATHS[1:]
    rows = []

    async def one(path: str, tag: str) -> float:
        t0 = time.perf_counter()
        await clients[path].prefill(list(prompt.tokens), request_id=tag, cache_salt=prompt.salt)
        return time.perf_counter() - t0

    try:
        for path, client in clients.items():  # channels up, the prompt's blocks cached
            inner.reset(64)
            await closed_loop(client, [prompt] * 64, 8, f"warm-{path}", inner)
        for run in range(args.runs):
            for c in args.overhead_concurrency:
                bar.set_postfix_str(f"overhead run {run} c={c}")
                rounds = -(-args.overhead_requests // c)  # per worker
                inner.reset(rounds * c * len(hop_paths) * 2)
                diffs = {hop: [] for hop in hop_paths}
                lat = {path: [] for path in PATHS}
                cpu0 = {hop: hops[hop].cpu_s() for hop in hop_paths}

                async def worker(w: int, run=run, c=c, rounds=rounds, diffs=diffs, lat=lat):
                    for r in range(rounds):
                        shift = (w + r + run) % len(hop_paths)
                        for hop in hop_paths[shift:] + hop_paths[:shift]:
                            first_hop = (w + r) % 2 == 0
                            order = (hop, "direct") if first_hop else ("direct", hop)
                            got = {}
                            for path in order:
                                got[path] = await one(path, f"o{run}-{c}-{w}-{r}-{hop}-{path}")
                                inner.update()
                            diffs[hop].append(got[hop] - got["direct"])
                            lat[hop].append(got[hop])
                            lat["direct"].append(got["direct"])

                t0 = time.perf_counter()
                await asyncio.gather(*(worker(w) for w in range(c)))
                wall = time.perf_counter() - t0
                for path in PATHS:
                    row = {"policy": "overhead", "path": path, "run": run, "concurrency": c,
                           "requests": len(lat[path]), "p50_s": statistics.median(lat[path]),
                           "wall_s": wall}  # fmt: skip
                    if path in diffs:
                        cpu = hops[path].cpu_s() - cpu0[path]
                        row |= {"pairs": len(diffs[path]),
                                "added_p50_s": statistics.median(diffs[path]),
                                "added_diffs_s": diffs[path],
                                "hop_cpu_ms_per_request": cpu / len(diffs[path]) * 1e3}  # fmt: skip
                    rows.append(row | provenance())
                bar.update()
    finally:
        for client in clients.values():
            await client.close()
    return rows


def _ratio_interval(num: list[float], den: list[float], seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of median(num) / median(den) over resampled pairs (400 draws):
    how stable the added-latency ratio is with this many pairs."""
    rng = random.Random(seed)
    draws = []
    for _ in range(400):
        a = statistics.median(rng.choices(num, k=len(num)))
        b = statistics.median(rng.choices(den, k=len(den)))
        if b > 0:
            draws.append(a / b)
    if len(draws) < 20:
        return float("nan"), float("nan")
    draws.sort()
    return draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


def core_rows(runs: int) -> list[dict]:
    """bench/router_core.py's measurements, through its own functions."""
    import router_core as core  # bench/ is on sys.path: this file runs as a script

    rng = random.Random(0)
    chains = core.random_chains(rng, CORE_BLOCKS)
    index, tokens, extra, views = core.routing_setup(CORE_RESIDENT, rng)
    stores, removes, steps = [], [], []
    for run in range(runs):
        store_s, remove_s = core.ingest_once(chains)
        stores.append(CORE_BLOCKS / store_s)
        removes.append(CORE_BLOCKS / remove_s)
        steps.append(core.route_once(index, tokens, extra, views, CORE_REPEATS, 1e4 * (run + 1)))
    step = {k: statistics.median(s[k] for s in steps) * 1e3 for k in steps[0]}
    total = statistics.median(s["hash"] + s["match"] + s["choose"] for s in steps) * 1e3
    figures = [
        ("ingest_block_stored", statistics.median(stores), "blocks/s", 500_000, False),
        ("ingest_block_removed", statistics.median(removes), "blocks/s", 500_000, False),
        ("route_32k_total", total, "ms", 2.0, True),
        ("route_32k_hash", step["hash"], "ms", None, True),
        ("route_32k_match", step["match"], "ms", None, True),
        ("route_32k_choose_4_pipelines", step["choose"], "ms", None, True),
        ("record_pending_32k", step["record_pending"], "ms", None, True),
    ]
    return [
        {"policy": "core", "metric": metric, "value": value, "unit": unit, "runs": runs}
        | provenance()
        | (
            {}
            if goal is None
            else {
                "goal": f"{'<=' if most else '>='} {goal:g}",
                "met": value <= goal if most else value >= goal,
            }
        )
        for metric, value, unit, goal, most in figures
    ]


# -- summary and output ---------------------------------------------------------------------------
def summarise(rows: list[dict]) -> list[dict]:
    """Medians per policy and per overhead (path, c); the goal ratios, paired by run."""
    out = []
    for policy in (*POLICIES, ORACLE):
        runs = [r for r in rows if r["policy"] == policy]
        if not runs:
            continue
        med = {"policy": policy, "run": "median", "runs": len(runs)}
        for key, value in runs[0].items():
            if key not in med and key != "order" and isinstance(value, int | float):
                values = [r.get(key, 0) for r in runs]  # a counter missing from a run is 0
                med[key] = statistics.median(v for v in values if v is not None)
        out.append(med)

    def per_run(policy: str, key: str) -> dict[int, float]:
        return {r["run"]: r[key] for r in rows if r["policy"] == policy}

    def ratio(name: str, num: dict, den: dict, goal: float | None = None) -> None:
        paired = [num[run] / den[run] for run in num if run in den and den[run]]
        if paired:
            value = statistics.median(paired)
            row = {"policy": "ratio", "metric": name, "value": value, "runs": len(paired),
                   "min": min(paired), "max": max(paired)}  # fmt: skip
            out.append(row | ({} if goal is None else {"goal": f">= {goal}", "met": value >= goal}))

    prefix_tok_s = per_run("prefix", "input_tok_s")
    others = [p for p in POLICIES[1:] if p != "fetch"]
    for other in others:
        ratio(f"prefix_over_{other.replace('-', '_')}", prefix_tok_s, per_run(other, "input_tok_s"))
    cached, oracle = per_run("prefix", "cached_tokens"), per_run(ORACLE, "cached_tokens")
    ratio("prefix_cached_over_oracle", cached, oracle, 0.9)
    for other in others:
        name = f"prefix_cached_over_{other.replace('-', '_')}"
        ratio(name, cached, per_run(other, "cached_tokens"))
    ratio("fetch_over_prefix", per_run("fetch", "input_tok_s"), prefix_tok_s, 1.1)
    ratio("fetch_cached_over_oracle", per_run("fetch", "cached_tokens"), oracle, 0.95)

    overhead = [r for r in rows if r["policy"] == "overhead"]
    for c in dict.fromkeys(r["concurrency"] for r in overhead):
        cell = {path: [r for r in overhead if (r["path"], r["concurrency"]) == (path, c)]
                for path in PATHS}  # fmt: skip
        p50 = {path: statistics.median(r["p50_s"] for r in cell[path]) for path in PATHS}
        hops = PATHS[1:]
        cpu = {path: statistics.median(r["hop_cpu_ms_per_request"] for r in cell[path])
               for path in hops}  # fmt: skip
        added = {path: statistics.median(r["added_p50_s"] for r in cell[path]) for path in hops}
        pooled = {path: [d for r in cell[path] for d in r["added_diffs_s"]] for path in hops}
        row = {"policy": "overhead", "path": "summary", "run": "median", "concurrency": c,
               "pairs": len(pooled["router"]),
               **{f"{path}_p50_s": p50[path] for path in PATHS},
               **{f"{path}_added_s": added[path] for path in hops},
               **{f"{path}_cpu_ms_per_request": cpu[path] for path in hops},
               "router_over_proxy_cpu": cpu["router"] / cpu["proxy"],
               "front_over_proxy_cpu": cpu["front"] / cpu["proxy"]}  # fmt: skip
        if added["proxy"] > 0:  # else the proxy's hop hid in the noise: no ratio to judge
            value = statistics.median(pooled["router"]) / statistics.median(pooled["proxy"])
            low, high = _ratio_interval(pooled["router"], pooled["proxy"])
            # the ratio counts only when its interval is narrow: else more pairs are needed
            stable = high - low <= 0.2 * value
            row |= {"router_over_proxy_added": value, "ratio_ci95_low": low,
                    "ratio_ci95_high": high, "stable": stable, "goal": "<= 1.2",
                    "met": stable and high <= 1.2}  # fmt: skip
        out.append(row | provenance())
    return out


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write the rows here (plot: .png)")
    ap.add_argument("--runs", type=int, default=3, help="runs of every policy (median; default 3)")
    ap.add_argument("--requests", type=int, default=600, help="requests per policy and run")
    ap.add_argument(
        "--policies",
        type=lambda s: [p for p in s.split(",") if p],
        default=[*POLICIES, ORACLE],
        help=f"comma list of {', '.join((*POLICIES, ORACLE))} (default all)",
    )
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    ap.add_argument("--tenants", type=int, default=8, help="tenants (default 8)")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent over tenants' ranks")
    ap.add_argument(
        "--system-tokens",
        type=span,
        default=(512, 1024),
        metavar="LO,HI",
        help="a tenant's system prompt length, uniform (default 512,1024)",
    )
    ap.add_argument(
        "--suffix-tokens",
        type=span,
        default=(32, 128),
        metavar="LO,HI",
        help="a request's unique suffix length, uniform (default 32,128)",
    )
    ap.add_argument(
        "--cache-share",
        type=float,
        default=0.5,
        help="default --num-blocks: this share of all system-prompt blocks + the\n"
        "suffixes of c/2 requests in flight (default 0.5)",
    )
    ap.add_argument("--num-blocks", type=int, help="KV blocks per stage of a cluster pipeline")
    ap.add_argument("--max-chunk-tokens", type=int, default=512, help="pipeline chunk tokens")
    ap.add_argument(
        "--shared-cores",
        action="store_true",
        help="let both cluster pipelines use every core (default: each its own half)",
    )
    ap.add_argument(
        "--overhead-concurrency",
        default="1,32",
        type=lambda s: [int(c) for c in s.split(",") if c],
        help='concurrency levels of the overhead section (default 1,32; "": skip it)',
    )
    ap.add_argument(
        "--overhead-requests",
        type=int,
        default=1000,
        help="pairs (hop + direct) per hop, level and run, spread over c workers (default\n"
        "1000: enough for a router / proxy interval within 20%% on this machine)",
    )
    ap.add_argument("--core-runs", type=int, default=5, help="router_core runs (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `wavepp router` argument, repeatable (e.g. --router-arg=--affinity-slack=0.3)",
    )
    args = ap.parse_args()
    if min(args.runs, args.requests, args.concurrency, args.tenants) < 1:
        ap.error("--runs, --requests, --concurrency and --tenants must be >= 1")
    if unknown := set(args.policies) - {*POLICIES, ORACLE}:
        ap.error(f"unknown policies: {', '.join(sorted(unknown))}")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run the finallys
    spec = TenantWorkload(args.tenants, args.requests, args.zipf, args.system_tokens,
                        args.suffix_tokens, VOCAB, args.seed)  # fmt: skip
    if args.num_blocks is None:
        args.num_blocks = default_num_blocks(spec, BLOCK, args.cache_share, args.concurrency)
    args.warm_tokens = min(512, args.system_tokens[0])  # warm-up prompts: shorter than any
    longest = -(-spec.longest_prompt() // BLOCK)
    if args.num_blocks <= longest:
        raise SystemExit(f"--num-blocks {args.num_blocks}: the longest prompt needs {longest}")
    print(f"system prompts: {spec.prefix_blocks(BLOCK)} blocks over {args.tenants} tenants; "
          f"{args.num_blocks} blocks per stage of a cluster pipeline")  # fmt: skip
    levels = args.overhead_concurrency
    total = 1 + args.runs * (len(args.policies) + len(levels))
    rows: list[dict] = []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    save = lambda extra=(): args.json.write_text(json.dumps([*rows, *extra], indent=1) + "\n")
    bar = tqdm(total=total, desc="router bench", position=0)
    inner = tqdm(total=args.requests, desc="requests", position=1, leave=False)
    try:
        with tempfile.TemporaryDirectory(prefix="wavepp-bench-router-") as tmp:
            from prefill_node.model.config import ModelConfig
            from prefill_node.model.loader_hf import save_hf_checkpoint
            from prefill_node.model.weights import random_weights

            model_dir, logs = Path(tmp) / "bench-router", Path(tmp)
            config = ModelConfig.from_hf_config(MODEL_HF, name="bench-router")
            save_hf_checkpoint(model_dir, config, random_weights(config, seed=0))
            bar.set_postfix_str("router core")
            core = core_rows(args.core_runs)
            rows += core
            bar.update()
            for run in range(args.runs):
                requests = spec.requests_of_run(run)
                order = args.policies[:: -1 if run % 2 else 1]
                for position, policy in enumerate(order):
                    bar.set_postfix_str(f"run {run} {policy}")
                    inner.reset(len(requests))
                    tag = f"{policy}-{run}"
                    row = measure_policy(policy, requests, args, model_dir, logs, tag, inner)
                    head = {"policy": policy, "run": run, "order": position}
                    rows.append(head | {"concurrency": args.concurrency, **row} | provenance())
                    save()
                    bar.update()
            rows += measure_overhead(args, model_dir, logs, bar, inner)
    finally:
        inner.close()
        bar.close()
    summary = summarise(rows)
    save(summary)
    print_tables(summary, core, args)
    plot(rows, summary, args.json.with_suffix(".png"))
    print(f"\nrows: {args.json}, plot: {args.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
