"""Benchmark: what the gRPC front adds per request over calling the engine in-process.

For each engine, the same requests run at the same concurrency (default 128) two ways:
``inproc`` (threads calling ``engine.submit(...).result()`` directly) and ``grpc`` (an
asyncio client in this process, the server and engine in a child process, loopback TCP).
Paths: ``grpc`` (unary Prefill calls), ``grpc_stream`` (one PrefillStream call carrying all
requests) and ``grpc_floor`` (unary calls to a bare servicer that only parses the ids with
our own function, submits and answers: the cost of Python gRPC itself, so ``grpc -
grpc_floor`` is what this servicer adds). Every row carries its provenance.
Reported per run: p50 / p99 / mean latency and throughput, the per-request overhead
``client latency - engine time`` (the engine time travels back in the response) and the
server process's CPU time per request. Engines:

- ``fixed``: completes every request after a service time drawn uniformly from
  ``service_ms * [1 - jitter, 1 + jitter]`` (default 20 ms +-50%; the jitter keeps the 128
  requests from completing in lock-step bursts) with unlimited parallelism and no CPU use -
  isolates the cost of the gRPC stack itself;
- ``local``: the real 2-stage LocalEngine on a tiny random model (its leader packs
  concurrent requests into waves; at high concurrency latency is mostly queueing for
  admission and wave slots inside the engine).

    python bench/grpc_overhead.py --json /tmp/grpc_overhead.json [--runs 3] [--requests 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import multiprocessing as mp
import random
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from provenance import provenance
from tqdm import tqdm

from prefill_node.engine.types import (
    EngineHealth,
    EngineLoad,
    PrefillOptions,
    PrefillResult,
    PrefillTimings,
    StageLoad,
)

PATHS = ("inproc", "grpc", "grpc_stream", "grpc_floor")


class FixedLatencyEngine:
    """Engine that answers every request ``service_s`` after submit (timer thread, no CPU)."""

    def __init__(self, service_s: float, jitter: float = 0.0, vocab_size: int = 1000) -> None:
        self._service_s = service_s
        self._jitter = jitter
        self._rng = random.Random(0)
        self._vocab = vocab_size
        self._heap: list[tuple[float, int, Future, PrefillResult]] = []
        self._seq = 0
        self._cv = threading.Condition()
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    vocab_size = property(lambda self: self._vocab)
    max_model_len = property(lambda self: 4096)

    def submit(self, token_ids: Sequence[int], options: PrefillOptions) -> Future[PrefillResult]:
        future: Future[PrefillResult] = Future()
        future.set_running_or_notify_cancel()
        t = self._service_s * (1 + self._jitter * (2 * self._rng.random() - 1))
        result = PrefillResult(
            options.request_id or "",
            int(token_ids[-1]),
            ((int(token_ids[-1]), -0.1),),
            len(token_ids),
            0,
            len(token_ids),
            PrefillTimings(compute_s=t, total_s=t),
        )
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + t, self._seq, future, result))
            self._cv.notify()
        return future

    def abort(self, request_id: str) -> bool:
        return False

    def load(self) -> EngineLoad:
        return EngineLoad(0, len(self._heap), 0, (StageLoad(0, 1, 0, 0, 1),))

    def health(self) -> EngineHealth:
        return EngineHealth(live=True, ready=True)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stop:
                    return
                _, _, future, result = heapq.heappop(self._heap)
            future.set_result(result)


def make_engine(kind: str, service_s: float, jitter: float):
    if kind == "fixed":
        return FixedLatencyEngine(service_s, jitter)
    import torch

    from prefill_node.model.config import ModelConfig, ModelFamily
    from prefill_node.model.weights import random_weights
    from prefill_node.runtime.engine_config import EngineConfig
    from prefill_node.runtime.local_engine import LocalEngine

    torch.set_num_threads(1)
    config = ModelConfig(
        family=ModelFamily.QWEN3,
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        name="bench-tiny",
    )
    engine_config = EngineConfig(stages=2, num_blocks=4096, block_size=16)
    return LocalEngine.from_weights(config, random_weights(config, seed=0), engine_config)


def _bare_server(engine):
    """The floor: a bare grpc.aio servicer that only parses the ids (as ours does:
    ``convert.token_ids_of``), submits and answers (no validation, metrics, health,
    deadlines or manifests) - what any Python gRPC front must pay."""
    import grpc

    from prefill_node.wire.convert import token_ids_of
    from wavepp_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

    class Bare(prefill_pb2_grpc.PrefillServiceServicer):
        async def Prefill(self, request, context):
            options = PrefillOptions(request_id=request.request_id, top_logprobs=1)
            r = await asyncio.wrap_future(engine.submit(token_ids_of(request.token_ids), options))
            timings = prefill_pb2.PrefillTimings(engine_seconds=r.timings.total_s)
            return prefill_pb2.PrefillResponse(
                request_id=r.request_id, first_token_id=r.first_token_id, timings=timings
            )

    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(Bare(), server)
    return server, server.add_insecure_port("127.0.0.1:0")


def _serve_child(kind: str, service_s: float, jitter: float, bare: bool, conn) -> None:
    """Child process: engine + server on loopback; sends the port, answers "cpu" with its CPU
    seconds, stops on anything else."""
    from prefill_node.server.server import PrefillServer, ServerConfig

    async def main() -> None:
        engine = make_engine(kind, service_s, jitter)
        if bare:
            server, port = _bare_server(engine)
        else:
            # the fixed engine's submit only enqueues: call it inline (as for the pipeline)
            config = ServerConfig(host="127.0.0.1", port=0, blocking_submit=kind != "fixed")
            server = PrefillServer(engine, config)
        await server.start()
        conn.send(port if bare else server.port)
        while await asyncio.to_thread(conn.recv) == "cpu":
            conn.send(time.process_time())  # CPU seconds of this process, all threads
        await server.stop(0)
        engine.shutdown()

    asyncio.run(main())


def _stats(latencies: list[float], overheads: list[float], wall_s: float) -> dict:
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    oq = statistics.quantiles(overheads, n=100, method="inclusive")
    return {
        "requests": len(latencies),
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "mean_ms": statistics.fmean(latencies) * 1e3,
        "throughput_rps": len(latencies) / wall_s,
        "overhead_p50_ms": oq[49] * 1e3,
        "overhead_p99_ms": oq[98] * 1e3,
    }


def run_inproc(engine, prompts: list[list[int]], concurrency: int) -> dict:
    lat: list[float] = []
    over: list[float] = []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        r = engine.submit(prompts[i], PrefillOptions(request_id=f"i{i}", top_logprobs=1)).result()
        dt = time.perf_counter() - t0
        lat.append(dt)
        over.append(dt - r.timings.total_s)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(prompts))))
    return _stats(lat, over, time.perf_counter() - t0)


async def run_grpc(target: str, prompts: list[list[int]], concurrency: int, tag: str) -> dict:
    from prefill_node.client.prefill_client import AsyncPrefillClient

    lat: list[float] = []
    over: list[float] = []
    it = iter(range(len(prompts)))
    async with AsyncPrefillClient(target) as client:

        async def worker() -> None:
            for i in it:
                t0 = time.perf_counter()
                r = await client.prefill(prompts[i], request_id=f"{tag}{i}", top_logprobs=1)
                dt = time.perf_counter() - t0
                lat.append(dt)
                over.append(dt - r.result.timings.total_s)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _stats(lat, over, time.perf_counter() - t0)


async def run_grpc_stream(target: str, prompts: list[list[int]], concurrency: int, tag: str):
    """The same load on ONE PrefillStream call, ``concurrency`` requests in flight on it."""
    import grpc

    from prefill_node.client.prefill_client import build_request
    from wavepp_proto.prefill.v1 import prefill_pb2_grpc

    lat: list[float] = []
    over: list[float] = []
    sent: dict[str, float] = {}
    slots = asyncio.Semaphore(concurrency)

    async def requests():
        for i, prompt in enumerate(prompts):
            await slots.acquire()
            sent[f"{tag}{i}"] = time.perf_counter()
            yield build_request(prompt, request_id=f"{tag}{i}", top_logprobs=1)

    async with grpc.aio.insecure_channel(target) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        t0 = time.perf_counter()
        async for entry in stub.PrefillStream(requests()):
            dt = time.perf_counter() - sent.pop(entry.request_id)
            slots.release()
            lat.append(dt)
            over.append(dt - entry.response.timings.engine_seconds)
        wall = time.perf_counter() - t0
    return _stats(lat, over, wall)


class _Child:
    """A server child process (ours, or the bare floor) and its control pipe."""

    def __init__(self, kind: str, args, bare: bool) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        params = (kind, args.service_ms / 1e3, args.jitter, bare, child)
        self._proc = ctx.Process(target=_serve_child, args=params)
        self._proc.start()
        self.target = f"127.0.0.1:{self._conn.recv()}"

    def cpu_s(self) -> float:
        self._conn.send("cpu")
        return self._conn.recv()

    def stop(self) -> None:
        self._conn.send("stop")
        self._proc.join(30)


def bench_engine(kind: str, args, bar: tqdm) -> list[dict]:
    rng = random.Random(0)
    n = args.requests if kind == "fixed" else args.local_requests

    def prompts() -> list[list[int]]:  # fresh prompts per call: no prefix reuse across runs
        return [[rng.randrange(1000) for _ in range(args.prompt_tokens)] for _ in range(n)]

    ours, floor = _Child(kind, args, bare=False), _Child(kind, args, bare=True)
    engine = make_engine(kind, args.service_ms / 1e3, args.jitter)
    clients = {
        "grpc": (ours, run_grpc),
        "grpc_stream": (ours, run_grpc_stream),
        "grpc_floor": (floor, run_grpc),
    }
    rows = []
    try:
        warm = prompts()[:256]
        asyncio.run(run_grpc(ours.target, warm, args.concurrency, "warm"))
        asyncio.run(run_grpc(floor.target, warm, args.concurrency, "warm"))
        run_inproc(engine, warm, args.concurrency)
        for run in range(args.runs):  # paths interleaved so background load hits all alike
            for path in PATHS:
                p = prompts()
                if path == "inproc":
                    stats = run_inproc(engine, p, args.concurrency)
                else:
                    child, run_fn = clients[path]
                    cpu0 = child.cpu_s()
                    stats = asyncio.run(run_fn(child.target, p, args.concurrency, f"{path}{run}-"))
                    stats["server_cpu_us_per_request"] = (child.cpu_s() - cpu0) / len(p) * 1e6
                rows.append(
                    {"engine": kind, "path": path, "run": run, "concurrency": args.concurrency}
                    | stats
                    | provenance()
                )
                bar.update(1)
    finally:
        ours.stop()
        floor.stop()
        engine.shutdown()
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """One row per engine and gRPC path: medians over runs, side by side with in-process."""

    def median(kind: str, path: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if (r["engine"], r["path"]) == (kind, path))

    out = []
    for kind in dict.fromkeys(r["engine"] for r in rows):
        i50, i99 = median(kind, "inproc", "p50_ms"), median(kind, "inproc", "p99_ms")
        for path in PATHS[1:]:
            g50, g99 = median(kind, path, "p50_ms"), median(kind, path, "p99_ms")
            out.append(
                {
                    "engine": kind,
                    "path": f"summary:{path}",
                    "run": "median",
                    "concurrency": rows[0]["concurrency"],
                    "inproc_p50_ms": i50,
                    "grpc_p50_ms": g50,
                    "added_p50_ms": g50 - i50,
                    "inproc_p99_ms": i99,
                    "grpc_p99_ms": g99,
                    "added_p99_ms": g99 - i99,
                    "overhead_p50_ms": median(kind, path, "overhead_p50_ms"),
                    "overhead_p99_ms": median(kind, path, "overhead_p99_ms"),
                    "server_cpu_us_per_request": median(kind, path, "server_cpu_us_per_request"),
                    "p50_ratio": g50 / i50,
                    "throughput_ratio": median(kind, path, "throughput_rps")
                    / median(kind, "inproc", "throughput_rps"),
                    **provenance(),
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True, help="write rows (list of dicts) here")
    ap.add_argument("--engines", default="fixed,local", help="comma list of: fixed, local")
    ap.add_argument("--concurrency", type=int, default=128, help="requests in flight")
    ap.add_argument("--runs", type=int, default=3, help="runs per path (median reported)")
    ap.add_argument("--requests", type=int, default=2048, help="requests per run, fixed engine")
    ap.add_argument("--local-requests", type=int, default=512, help="requests per run, local")
    ap.add_argument("--service-ms", type=float, default=20.0, help="fixed engine service time")
    ap.add_argument("--jitter", type=float, default=0.5, help="fixed engine: +- this fraction")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    args = ap.parse_args()
    kinds = [k for k in args.engines.split(",") if k]
    rows: list[dict] = []
    with tqdm(total=len(kinds) * args.runs * len(PATHS), desc="grpc overhead") as bar:
        for kind in kinds:
            rows += bench_engine(kind, args, bar)
    summary = summarise(rows)
    args.json.write_text(json.dumps(rows + summary, indent=1))
    cols = [
        "engine",
        "path",
        "inproc_p50_ms",
        "grpc_p50_ms",
        "added_p50_ms",
        "inproc_p99_ms",
        "grpc_p99_ms",
        "added_p99_ms",
        "overhead_p50_ms",
        "overhead_p99_ms",
        "server_cpu_us_per_request",
        "throughput_ratio",
    ]
    print(f"concurrency {args.concurrency}, median of {args.runs} runs (ms unless noted)")
    print(" | ".join(cols))
    for row in summary:
        print(
            " | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols)
        )


if __name__ == "__main__":
    main()
