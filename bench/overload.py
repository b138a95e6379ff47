"""Overload run: does the tier shed early instead of queueing for seconds?

Starts a local tier (`wavepp router` in front of ``--pipelines`` `wavepp serve` pipelines,
processes on loopback), measures its capacity (requests answered per second by a closed loop
of ``--capacity-concurrency`` clients), then offers ``--levels`` times that capacity (default
0.5x, 1x, 2x, 4x) as an open loop: Poisson arrivals for ``--duration-s`` each, every request
a fresh prompt (no prefix reuse) with a deadline of ``--deadline-s`` (the request's
``timeout``; the call's own deadline a little later), tenants drawn from ``--tenants``.

Each level runs once per router ``--max-wait`` setting (``--max-waits``, default ``0,0.5,1``:
no wait bound, only deadlines shed; then a 0.5 s and a 1 s bound), each setting its own
router in front of the same pipelines, the capacity measured once through the first. One row
per setting and level, each after a quiet machine (bench/quiet.py), with provenance
(bench/provenance.py): ``max_wait_s``, ``offered_x``, ``offered_per_s``, ``requests``,
``goodput_per_s`` (answered OK within the deadline, per second from the level's first
arrival to its last answer, ``wall_s``), ``rejected_share`` (RESOURCE_EXHAUSTED: shed by the
router), ``deadline_share`` (DEADLINE_EXCEEDED),
``other_share``, and ``p50_s`` / ``p95_s`` over the admitted requests that were answered.

    .venv/bin/python bench/overload.py --json /tmp/overload.json

Goals (issue 29): at 2x and 4x, goodput >= 90% of the 1x goodput and admitted p95 within 2x of
the 1x p95 of the same setting, each the median of ``--runs`` runs. A smoke run: ``--levels 0.5,2
--capacity-s 2 --duration-s 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from collections import Counter
from pathlib import Path

from provenance import provenance
from quiet import wait_quiet
from router_cluster import MODEL_HF, VOCAB, Cluster, pipeline_cpus, warm_pipeline, warm_router


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="write the rows here")
    p.add_argument("--pipelines", type=int, default=2, help="default 2")
    p.add_argument("--stages", type=int, default=2, help="stages per pipeline (default 2)")
    p.add_argument("--num-blocks", type=int, default=512, help="per stage (default 512)")
    p.add_argument("--max-chunk-tokens", type=int, default=256, help="default 256")
    p.add_argument("--prompt-tokens", type=int, default=256, help="default 256")
    p.add_argument("--deadline-s", type=float, default=10.0, help="per request (default 10)")
    p.add_argument("--tenants", type=int, default=8, help="cache salts drawn (default 8)")
    p.add_argument("--levels", default="0.5,1,2,4", help="offered x capacity (default 0.5,1,2,4)")
    p.add_argument("--capacity-s", type=float, default=20.0, help="capacity run (default 20)")
    p.add_argument("--capacity-concurrency", type=int, default=8, help="default 8")
    p.add_argument("--duration-s", type=float, default=60.0, help="per level (default 60)")
    p.add_argument(
        "--max-waits",
        default="0,0.5,1",
        help="the router's --max-wait settings, seconds, each its own set of rows (0: no "
        "bound; default 0,0.5,1)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat every setting's levels this many times, interleaved (rows carry `run`; the "
        "summary prints medians; default 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra `wavepp router` flag (repeatable, e.g. --router-arg=--max-queue=64)",
    )
    return p.parse_args(argv)


class Load:
    """Prompts and calls against the router (grpc.aio, one channel)."""

    def __init__(self, target: str, args: argparse.Namespace, seed: int) -> None:
        import grpc

        from wavepp_proto.prefill.v1 import prefill_pb2_grpc

        self._grpc = grpc
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = prefill_pb2_grpc.PrefillServiceStub(self._channel)
        self._args = args
        self._rng = random.Random(seed)
        self._n = 0

    async def one(self, deadline_s: float | None) -> tuple[str, float]:
        """One fresh prompt: (status name, seconds)."""
        from prefill_node.client.prefill_client import build_request

        self._n += 1
        rng = self._rng
        request = build_request(
            [rng.randrange(VOCAB) for _ in range(self._args.prompt_tokens)],
            request_id=f"o{self._n}",
            cache_salt=f"tenant-{rng.randrange(self._args.tenants)}",
            timeout_s=deadline_s,
        )
        t0 = time.perf_counter()
        try:
            await self._stub.Prefill(
                request, timeout=None if deadline_s is None else deadline_s + 5
            )
            status = "OK"
        except self._grpc.aio.AioRpcError as exc:
            status = exc.code().name
        return status, time.perf_counter() - t0

    async def close(self) -> None:
        await self._channel.close()


async def capacity(load: Load, concurrency: int, duration_s: float) -> float:
    """Requests answered OK per second by a closed loop of ``concurrency`` clients."""
    stop = time.perf_counter() + duration_s
    done = Counter()

    async def client() -> None:
        while time.perf_counter() < stop:
            status, _ = await load.one(None)
            done[status] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done["OK"] / (time.perf_counter() - t0)


async def offer(load: Load, rate_per_s: float, duration_s: float, deadline_s: float, seed: int):
    """Poisson arrivals at ``rate_per_s`` for ``duration_s``: every request's outcome, and
    the seconds until the last one ended (a queue drains after the arrivals stop)."""
    rng = random.Random(seed)
    tasks = []
    start = time.perf_counter()
    at = start
    while True:
        at += rng.expovariate(rate_per_s)
        if at - start >= duration_s:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(load.one(deadline_s)))
    outcomes = await asyncio.gather(*tasks)
    return outcomes, time.perf_counter() - start


def row(offered_x: float, rate: float, wall_s: float, deadline_s: float, outcomes) -> dict:
    n = len(outcomes)
    by = Counter(status for status, _ in outcomes)
    answered = sorted(s for status, s in outcomes if status == "OK")
    good = sum(1 for s in answered if s <= deadline_s)
    other = n - by["OK"] - by["RESOURCE_EXHAUSTED"] - by["DEADLINE_EXCEEDED"]
    q = statistics.quantiles(answered, n=20) if len(answered) >= 2 else answered * 19
    return {
        "offered_x": offered_x,
        "offered_per_s": round(rate, 3),
        "requests": n,
        "goodput_per_s": round(good / wall_s, 3),
        "wall_s": round(wall_s, 3),
        "rejected_share": round(by["RESOURCE_EXHAUSTED"] / n, 4) if n else 0.0,
        "deadline_share": round(by["DEADLINE_EXCEEDED"] / n, 4) if n else 0.0,
        "other_share": round(other / n, 4) if n else 0.0,
        "p50_s": round(statistics.median(answered), 4) if answered else None,
        "p95_s": round(q[18], 4) if answered else None,
    }


async def capacity_of(target: str, args: argparse.Namespace) -> float:
    load = Load(target, args, args.seed - 1)
    try:
        wait_quiet()
        cap = await capacity(load, args.capacity_concurrency, args.capacity_s)
    finally:
        await load.close()
    print(f"capacity: {cap:.2f} requests/s", file=sys.stderr)
    return cap


async def measure(
    target: str, args: argparse.Namespace, cap: float, max_wait_s: float, run: int
) -> list[dict]:
    seed = args.seed + 1000 * run
    load = Load(target, args, seed)
    try:
        rows = []
        for i, x in enumerate(float(v) for v in args.levels.split(",")):
            settle = wait_quiet()
            rate = max(cap * x, 1e-3)
            outcomes, wall_s = await offer(load, rate, args.duration_s, args.deadline_s, seed + i)
            r = {"max_wait_s": max_wait_s, "run": run,
                 **row(x, rate, wall_s, args.deadline_s, outcomes),
                 "capacity_per_s": round(cap, 3), "settle_s": round(settle, 2)}  # fmt: skip
            print(json.dumps(r), file=sys.stderr)
            rows.append({**r, **provenance()})
        return rows
    finally:
        await load.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from prefill_node.model.config import ModelConfig
    from prefill_node.model.loader_hf import save_hf_checkpoint
    from prefill_node.model.weights import random_weights

    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        model_dir, logs = Path(tmp) / "model", Path(tmp) / "logs"
        logs.mkdir()
        config = ModelConfig.from_hf_config(MODEL_HF, name="bench-overload")
        save_hf_checkpoint(model_dir, config, random_weights(config, seed=0))
        cluster_args = Namespace(max_chunk_tokens=args.max_chunk_tokens, router_arg=args.router_arg)
        with Cluster(model_dir, logs, cluster_args) as cluster:
            pipelines = [
                cluster.serve(
                    f"p{i}", args.num_blocks, pipeline_cpus(i, args.pipelines), args.stages
                )  # fmt: skip
                for i in range(args.pipelines)
            ]
            for p in pipelines:
                warm_pipeline(p.wait_listening().address, args.prompt_tokens)
            rows, cap = [], None
            for run in range(args.runs):
                for wait in (float(v) for v in args.max_waits.split(",")):
                    tag = f"-{wait}-{run}"
                    router = cluster.router("prefix", pipelines, (f"--max-wait={wait}",), tag)
                    warm_router(router.address, args.pipelines)
                    if cap is None:
                        cap = asyncio.run(capacity_of(router.address, args))
                    rows += asyncio.run(measure(router.address, args, cap, wait, run))
                    router.stop()
    args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    print_medians(rows)
    return 0


def print_medians(rows: list[dict]) -> None:
    """The table docs quote: per setting and level, the median over runs of each figure."""
    keys = ("goodput_per_s", "rejected_share", "deadline_share", "p50_s", "p95_s")
    print("max_wait_s offered_x runs " + " ".join(keys), file=sys.stderr)
    cells: dict[tuple[float, float], list[dict]] = {}
    for r in rows:
        cells.setdefault((r["max_wait_s"], r["offered_x"]), []).append(r)
    for (wait, x), rs in cells.items():
        meds = []
        for k in keys:
            vals = [r[k] for r in rs if r[k] is not None]
            meds.append(f"{statistics.median(vals):.4g}" if vals else "-")
        print(f"{wait:g} {x:g} {len(rs)} " + " ".join(meds), file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
