"""The soak's processes: pipelines and the router on fixed ports (router_cluster.Server), a
supervisor that restarts a pipeline as Kubernetes would (process gone, or liveness failing
three probes in a row), decode-driver children, and /proc samples of every long-lived
process (RSS, open file descriptors)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from router_cluster import START_TIMEOUT_S, Server  # bench/ is on sys.path

from prefill_node.process_tree import ProcessTree
from prefill_node.runtime.dist_env import free_local_port

BLOCK = 16
SOAK_HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
VOCAB = SOAK_HF["vocab_size"]
MAX_MODEL_LEN = SOAK_HF["max_position_embeddings"]
STAGE_MAIN = "prefill_node.runtime.stage_main"
# The chart probes every 10 s, 3 failures in a row restart the pod; faster here, but with
# kubelet's 1 s probe timeout tripled, since 7 processes share 2 cores during a soak.
LIVENESS_PERIOD_S, LIVENESS_TIMEOUT_S, LIVENESS_FAILURES = 1.0, 3.0, 3
# The soak's clients cap gRPC's reconnect backoff (as the router does towards its pipelines):
# a restarted router is reached within this long of listening again, not after a backoff
# that grew while it was down.
CLIENT_BACKOFF_S = 1.0


def write_model(model_dir: Path) -> Path:
    from prefill_node.model.config import ModelConfig
    from prefill_node.model.loader_hf import save_hf_checkpoint
    from prefill_node.model.weights import random_weights

    config = ModelConfig.from_hf_config(SOAK_HF, name="soak")
    save_hf_checkpoint(model_dir, config, random_weights(config, seed=0))
    return model_dir


class Restartable:
    """One named server on a fixed port; ``restart`` stops what is there and starts anew."""

    def __init__(self, name: str, argv: Callable[[int], list[str]], banner: str, logs: Path):
        self.name, self._argv, self._banner, self._logs = name, argv, banner, logs
        self.port = free_local_port()  # below the ephemeral range: a restart gets it back
        self.address = f"127.0.0.1:{self.port}"
        self.server: Server | None = None
        self.starts = 0
        self.metrics_port: int | None = None
        self.lock = threading.Lock()

    def start(self) -> Restartable:
        log = self._logs / f"{self.name}.{self.starts}.log"
        self.starts += 1
        for attempt in range(20):  # the old process's port may linger for a moment
            server = Server(self._argv(self.port), self._banner, log)
            try:
                server.wait_listening()
                break
            except RuntimeError:
                server.stop()
                if attempt == 19:
                    raise
                time.sleep(0.5)
        self.server, self.metrics_port = server, server.metrics_port
        return self

    def restart(self) -> tuple[float, float]:
        """Seconds to stop the old process, seconds to start the new one."""
        with self.lock:
            t0 = time.monotonic()
            self.stop()
            t1 = time.monotonic()
            self.start()
            return t1 - t0, time.monotonic() - t1

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server is not None else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.server.pid, sig)

    def stage_pids(self) -> list[int]:
        """The pipeline's stage processes (children running stage_main)."""
        if self.pid is None:
            return []
        out = []
        for pid in ProcessTree(self.pid).pids()[1:]:
            with contextlib.suppress(OSError):
                if STAGE_MAIN in Path(f"/proc/{pid}/cmdline").read_text():
                    out.append(pid)
        return sorted(out)


def pipeline_argv(model: Path, name: str, args) -> Callable[[int], list[str]]:
    return lambda port: [
        "serve",
        "--model",
        str(model),
        "--stages",
        "2",
        "--num-blocks",
        str(args.num_blocks),
        "--block-size",
        str(BLOCK),
        "--max-chunk-tokens",
        "128",
        "--threads",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        "0",
        "--pipeline-id",
        name,
        "--log-level",
        "WARNING",
        "--kv-transfer-timeout",
        str(args.kv_timeout),
        "--kv-lease-ttl",
        str(args.kv_timeout),
        "--debug-service",
        "--grace",
        "1",
    ]


def router_argv(model: Path, pipelines: list[Restartable]) -> Callable[[int], list[str]]:
    def argv(port: int) -> list[str]:
        out = [
            "router",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--poll-interval",
            "0.25",
            "--max-message-mb",
            "1",
            "--log-level",
            "WARNING",
            "--grace",
            "1",
        ]
        for p in pipelines:
            out += ["--pipeline", p.address]
        return out

    return argv


class Supervisor:
    """Restarts a pipeline whose process exited or whose liveness failed LIVENESS_FAILURES
    probes in a row (Kubernetes' restart of a pod group); ``paused`` while a fault owns it."""

    def __init__(self, pipelines: list[Restartable], on_restart: Callable[..., None]):
        self._pipelines = pipelines
        self._on_restart = on_restart
        self._stop = threading.Event()
        self._failures = dict.fromkeys((p.name for p in pipelines), 0)
        self.paused: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="soak-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(LIVENESS_PERIOD_S):
            for p in self._pipelines:
                if p.name in self.paused or p.server is None:
                    continue
                exited = p.server.popen.poll() is not None
                failure = "process exited" if exited else _liveness_failure(p.address)
                self._failures[p.name] = self._failures[p.name] + 1 if failure else 0
                if exited or self._failures[p.name] >= LIVENESS_FAILURES:
                    self._failures[p.name] = 0
                    self._on_restart(p.name, failure, *p.restart())


def _liveness_failure(address: str) -> str:
    """Why one liveness probe failed ("" when it passed)."""
    import grpc

    from prefill_node.client.prefill_client import PrefillClient

    try:
        with PrefillClient(address) as c:
            return "" if c.is_live(timeout_s=LIVENESS_TIMEOUT_S) else "liveness NOT_SERVING"
    except grpc.RpcError as exc:
        return f"liveness probe failed: {exc.code().name}"


class DecodeDriver:
    """A ``soak_decode.py`` child: a decode worker doing push / pull hand-offs through the
    router; each request is announced and each ended one reported as JSON lines on its
    stdout, into ``tally`` (soak_workload.Tally). ``kill`` ends the ones it had in flight
    DECODER_KILLED."""

    def __init__(self, name: str, router: str, model: Path, args, logs: Path, tally) -> None:
        self.name, self._router, self._model, self._args = name, router, model, args
        self._logs, self._tally = logs, tally
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.starts = 0
        self.final: dict | None = None
        self.open_ids: set[str] = set()
        self.ok_rows = 0  # requests answered OK, over all its starts

    def start(self) -> DecodeDriver:
        script = Path(__file__).with_name("soak_decode.py")
        log = open(self._logs / f"{self.name}.{self.starts}.log", "w")  # noqa: SIM115
        argv = [
            sys.executable,
            str(script),
            "--router",
            self._router,
            "--model",
            str(self._model),
            "--concurrency",
            str(self._args.decode_concurrency),
            "--seed",
            f"{self.name}-{self.starts}",
            "--kv-timeout",
            str(self._args.kv_timeout),
        ]
        self.starts += 1
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        log.close()
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("final"):
                self.final = row
            elif "begin" in row:
                self.open_ids.add(row["begin"])
                self._tally.external_begin(row)
            else:
                self.open_ids.discard(row["id"])
                self.ok_rows += row["code"] == "OK"
                self._tally.external(row)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def kill(self) -> int:
        """SIGKILL; how many of its requests were in flight (each ends DECODER_KILLED)."""
        if self.proc is None:
            return 0
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self._reader is not None:
            self._reader.join(10)  # every line it wrote before dying is read
        killed, self.open_ids = self.open_ids, set()
        for rid in killed:
            self._tally.end(rid, "DECODER_KILLED", "its decode worker was killed")
        return len(killed)

    def stop(self, timeout_s: float = START_TIMEOUT_S) -> dict | None:
        """SIGTERM: finish in-flight hand-offs, check the decode side, report; its report."""
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        time.sleep(0.2)  # the reader thread takes the last line
        return self.final


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_bytes(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


class TcpCut:
    """A loopback TCP forwarder in front of ``upstream`` (own thread and event loop); ``cut``
    resets every connection through it at once: the router's KV-event stream to that
    pipeline breaks (and whatever else rode the connection), as a network blip would."""

    def __init__(self, upstream: str) -> None:
        import asyncio

        self._upstream = upstream.rsplit(":", 1)
        self._loop = asyncio.new_event_loop()
        self._writers: set = set()
        self.port = free_local_port()
        self.address = f"127.0.0.1:{self.port}"
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        import asyncio

        asyncio.set_event_loop(self._loop)

        async def pipe(reader, writer) -> None:
            with contextlib.suppress(Exception):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def handle(reader, writer) -> None:
            try:
                up_r, up_w = await asyncio.open_connection(
                    self._upstream[0], int(self._upstream[1])
                )
            except OSError:
                writer.close()
                return
            self._writers |= {writer, up_w}
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
            self._writers -= {writer, up_w}

        async def main() -> None:
            await asyncio.start_server(handle, "127.0.0.1", self.port)
            ready.set()

        self._loop.run_until_complete(main())
        self._loop.run_forever()

    def cut(self) -> int:
        """Reset every live connection; how many there were."""

        def reset() -> int:
            n = len(self._writers)
            for w in list(self._writers):
                with contextlib.suppress(Exception):
                    w.transport.abort()
            self._writers.clear()
            return n

        import asyncio

        return asyncio.run_coroutine_threadsafe(_call(reset), self._loop).result(10)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


async def _call(fn):
    return fn()
