"""The local cluster bench/router.py measures: `wavepp serve` / `wavepp router` processes, a bare
grpc.aio pass-through proxy, warm-ups and the router's counters (processes in their own
sessions, stopped SIGTERM-then-SIGKILL)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

from prefill_node.cli.options import parse_listening

MODEL_HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
"""On a 2-core VM with a core per stage, an 800-token prompt takes ~115 ms cold and ~30 ms
after a cached 768-token prefix; a gRPC round trip ~9 ms: compute dominates."""
VOCAB = MODEL_HF["vocab_size"]
BLOCK = 16
WARMUP_SALT = "warmup"  # no measured request uses it: its blocks never match
PREFILL_METHOD = "/wavepp.prefill.v1.PrefillService/Prefill"
CLI = [sys.executable, "-m", "prefill_node.cli.main"]
START_TIMEOUT_S = 120.0


# -- processes ------------------------------------------------------------------------------------
class Server:
    """A `wavepp serve` / `wavepp router` child in its own session, so that ``stop`` takes
    its stage processes with it; stderr goes to ``log`` (shown when something fails).
    ``cpus``: run it (and so its stages) on these cores only (taskset)."""

    def __init__(
        self, argv: list[str], banner: str, log: Path, cpus: list[int] | None = None
    ) -> None:
        self.banner, self.log = banner, log
        pin = ["taskset", "--cpu-list", ",".join(map(str, cpus))] if cpus else []
        with open(log, "w") as err:
            self.popen = subprocess.Popen(
                [*pin, *CLI, *argv],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.address = ""
        self.metrics_port: int | None = None

    def wait_listening(self) -> Server:
        """Block until its first stdout line says where it listens."""
        ready, _, _ = select.select([self.popen.stdout], [], [], START_TIMEOUT_S)
        line = self.popen.stdout.readline() if ready else ""
        found = parse_listening(line)
        if found is None or f"wavepp {found.name}:" != self.banner:
            raise RuntimeError(f"{self.banner} did not start ({line!r}):\n{self.log_tail()}")
        self.address, self.metrics_port = found.target, found.metrics_port
        return self

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # anything left of its session
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()
        self.popen.stdout.close()


def _proxy_main(upstream: str, conn) -> None:
    """The proxy child: forwards Prefill as opaque bytes (no parsing, validation, metrics,
    health or deadlines beyond the caller's); sends its port, stops on any message."""
    import grpc

    async def main() -> None:
        channel = grpc.aio.insecure_channel(upstream)
        forward = channel.unary_unary(PREFILL_METHOD)  # no (de)serializers: bytes both ways

        async def prefill(request: bytes, context) -> bytes:
            return await forward(request, timeout=context.time_remaining())

        service, method = PREFILL_METHOD.strip("/").split("/")
        handler = grpc.method_handlers_generic_handler(
            service, {method: grpc.unary_unary_rpc_method_handler(prefill)}
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await asyncio.to_thread(conn.recv)
        await server.stop(0)
        await channel.close()

    asyncio.run(main())


def _front_main(upstream: str, conn) -> None:
    """The FRONT child: the router's own gRPC front (PrefillServer: servicer, request
    validation, health, reflection, metrics, Prefill's bytes passed through) over an engine
    that forwards every request to ``upstream`` unrouted - the router minus routing, to split
    its hop into front + routing."""
    import grpc

    from prefill_node.engine.types import CacheIdentity, EngineHealth, EngineLoad
    from prefill_node.server.server import PrefillServer, ServerConfig
    from prefill_node.wire.convert import Relayed
    from wavepp_proto.prefill.v1 import prefill_pb2

    class Forwarder:  # a ResponseForwarder: the request's and the pipeline's bytes, passed on
        vocab_size, max_model_len = VOCAB, MODEL_HF["max_position_embeddings"]
        cache_identity = CacheIdentity("", 0)

        def __init__(self) -> None:
            self.prefill = None

        async def forward(self, request, parsed, raw):
            if self.prefill is None:  # aio channels bind to the serving loop
                channel = grpc.aio.insecure_channel(upstream)
                self.prefill = channel.unary_unary(PREFILL_METHOD, _registered_method=True)
            request_id = parsed.options.request_id
            if raw is None:
                raw = request.SerializeToString()
            if request.request_id != request_id:
                raw += prefill_pb2.PrefillRequest(request_id=request_id).SerializeToString()
            data = await self.prefill(raw, timeout=parsed.timeout_s)
            return Relayed(data, prefill_pb2.PrefillResponse.FromString(data), upstream)

        def health(self) -> EngineHealth:
            return EngineHealth(live=True, ready=True, detail="")

        def load(self) -> EngineLoad:
            return EngineLoad(0, 0, 0, ())

        def abort(self, request_id: str) -> bool:
            return False

    async def main() -> None:
        config = ServerConfig(host="127.0.0.1", port=0, blocking_submit=False)
        server = PrefillServer(Forwarder(), config)
        await server.start()
        conn.send(server.port)
        await asyncio.to_thread(conn.recv)
        await server.stop(0)

    asyncio.run(main())


class Proxy:
    """A hop in front of ``upstream`` in a spawned child: the bare grpc.aio pass-through
    (``front=False``) or the router's gRPC front without routing (``front=True``)."""

    def __init__(self, upstream: str, front: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        target = _front_main if front else _proxy_main
        self._proc = ctx.Process(target=target, args=(upstream, child), daemon=True)
        self._proc.start()
        self.pid = self._proc.pid
        if not self._conn.poll(START_TIMEOUT_S):
            self.stop()
            raise RuntimeError("the proxy did not start")
        self.address = f"127.0.0.1:{self._conn.recv()}"

    def stop(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send("stop")
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


class Cluster:
    """The processes of one measurement; leaving the block stops them all (newest first),
    printing their logs' tails when it is left by an error."""

    def __init__(self, model_dir: Path, logs: Path, args: argparse.Namespace) -> None:
        self._model, self._logs, self._args = model_dir, logs, args
        self._procs: list[Server | Proxy] = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt | SystemExit):
            for proc in self._procs:
                if isinstance(proc, Server):
                    print(f"--- {proc.log.name}:\n{proc.log_tail()}", file=sys.stderr)
        for proc in reversed(self._procs):
            try:
                proc.stop()
            except Exception as error:  # noqa: BLE001 - stop the others all the same
                print(f"could not stop pid {proc.pid}: {error!r}", file=sys.stderr)

    def serve(
        self,
        name: str,
        num_blocks: int,
        cpus: list[int] | None = None,
        stages: int = 2,
        extra: tuple[str, ...] = (),
        kv_agents: bool = False,
    ) -> Server:
        """Start a pipeline (returns at once: ``wait_listening`` before use); ``extra``: more
        `wavepp serve` flags (e.g. ``--dtype bfloat16``); ``kv_agents``: every stage runs
        its NIXL agent (KV hand-off, prefix fetch), else ``--no-kv-shipping``."""
        shipping = () if kv_agents else ("--no-kv-shipping",)
        argv = ["serve", "--model", str(self._model), "--stages", str(stages), "--num-blocks",
                str(num_blocks), "--block-size", str(BLOCK), "--max-chunk-tokens",
                str(self._args.max_chunk_tokens), "--threads", "1", "--host", "127.0.0.1",
                "--port", "0", "--metrics-port", "-1", *shipping, "--pipeline-id", name,
                "--log-level", "WARNING", *extra]  # fmt: skip
        return self._add(Server(argv, "wavepp serve:", self._logs / f"{name}.log", cpus))

    def router(
        self, policy: str, pipelines: list[Server], extra: tuple[str, ...] = (), tag: str = ""
    ) -> Server:
        """Start a router in front of ``pipelines``; ``extra``: more `wavepp router` flags
        (after ``--router-arg``'s); ``tag`` tells its log apart from another's of the same
        policy."""
        argv = ["router", "--model", str(self._model), "--policy", policy, "--host",
                "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
                "--log-level", "WARNING", *self._args.router_arg, *extra]  # fmt: skip
        for p in pipelines:
            argv += ["--pipeline", p.address]
        server = Server(argv, "wavepp router:", self._logs / f"router-{policy}{tag}.log")
        return self._add(server).wait_listening()

    def proxy(self, upstream: str, front: bool = False) -> Proxy:
        return self._add(Proxy(upstream, front))

    def _add(self, proc):
        self._procs.append(proc)
        return proc


def pipeline_cpus(i: int, pipelines: int) -> list[int] | None:
    """Pipeline ``i``'s share of this process's cores, as if each pipeline had its own host
    (its launcher then pins its stages inside that share); None with fewer cores than
    pipelines."""
    allowed = sorted(os.sched_getaffinity(0))
    k = len(allowed) // pipelines
    return allowed[i * k : (i + 1) * k] if k else None


def _wait(predicate, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    import grpc

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(grpc.RpcError):
            if predicate():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def warm_pipeline(address: str, tokens: int) -> None:
    """Ready, and torch warm: a cold ``tokens + 16``-token prompt, then one sharing its
    first ``tokens``."""
    from prefill_node.client.prefill_client import PrefillClient

    rng = random.Random(-1)
    base = [rng.randrange(VOCAB) for _ in range(tokens)]
    with PrefillClient(address) as client:
        _wait(client.is_ready, f"pipeline {address} ready")
        for tail in (16, 8):
            prompt = base + [rng.randrange(VOCAB) for _ in range(tail)]
            client.prefill(prompt, cache_salt=WARMUP_SALT)


def warm_router(address: str, pipelines: int) -> None:
    """Every pipeline ready and indexed (its warm-up blocks), then a few short requests."""
    from prefill_node.client.prefill_client import PrefillClient

    rng = random.Random(-2)
    with PrefillClient(address) as client:

        def indexed() -> bool:
            loads = client.load().pipelines
            return len(loads) == pipelines and all(p.ready and p.indexed_blocks for p in loads)

        _wait(indexed, "the router to index every pipeline")
        _wait(client.is_ready, "the router SERVING")
        for _ in range(4):
            client.prefill([rng.randrange(VOCAB) for _ in range(40)], cache_salt=WARMUP_SALT)


def router_counters(metrics_port: int) -> Counter[str]:
    """The router's cached-token prediction, decision and fetch counters from its /metrics."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("wavepp_router_cached_tokens_total"):
            kind = re.search(r'kind="(\w+)"', name).group(1)
            out[f"router_{kind}_cached_tokens"] += int(float(value))
        elif name.startswith("wavepp_router_decisions_total"):
            reason = re.search(r'reason="(\w+)"', name).group(1)
            out[f"decided_{reason}"] += int(float(value))
        elif name.startswith("wavepp_router_fetches_total"):
            outcome = re.search(r'outcome="(\w+)"', name).group(1)
            out[f"fetches_{outcome}"] += int(float(value))
    return out


# -- measurements ---------------------------------------------------------------------------------
