"""bench/pipeline.py's long-lived worker processes: one pipeline per policy, the ceiling's
pure-forward processes (``PipelineDriver`` also leads bench/stage_occupancy.py's pipelines).

Every policy's pipeline stays up for a whole run, each in its own driver process (a leader
hosts torch.distributed state, so two cannot share a process), and the three ceiling
processes stay up for the whole invocation. The bench can then run every cell on every
policy back to back and measure the ceiling right after them, so that the VM's drift over
minutes (+-10% on this machine) cancels out of the ratios instead of landing in them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
"""One stage's 512-token wave takes ~50 ms on one core of this machine (2 of the 4 layers at
~10K tok/s, bench/calibrate_cpu.py): the issue asks for 10-60 ms per stage wave."""
BLOCK, M, B_MIN, PROMPT = 16, 512, 256, 1024  # b_min = M/2, as the paper's 8K/16K
PREFIX = PROMPT * 9 // 10 // BLOCK * BLOCK  # 90% reuse, whole blocks: 912 cached, 112 computed
NUM_PREFIXES = 4
WARMUP_SEED = 999_999  # distinct from every timed draw (random.Random(-1) == random.Random(1))


@dataclass(frozen=True)
class Workload:
    name: str
    warm_share: float  # share of requests that reuse a seeded prefix


WORKLOADS = (Workload("cold", 0.0), Workload("reuse90", 1.0), Workload("mixed75", 0.75))


def workload(name: str) -> Workload:
    return next(w for w in WORKLOADS if w.name == name)


def shared_prefixes() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2048) for _ in range(PREFIX)] for _ in range(NUM_PREFIXES)]


def make_spec(policy: str):
    from prefill_node.runtime.spec import ModelSource, PipelineSpec

    return PipelineSpec(
        model=ModelSource(config=MODEL, seed=0, name="bench-tiny"),
        layer_ranges=((0, 2), (2, 4)),
        stage_blocks=(2048, 2048),
        block_size=BLOCK,
        policy=policy,
        max_wave_tokens=M,
        min_wave_tokens=B_MIN,
        max_batch=128,
    )


def prompts_for(w: Workload, n: int, rng: random.Random, prefixes: list[list[int]]):
    out = []
    for _ in range(n):
        if rng.random() < w.warm_share:
            tail = [rng.randrange(2048) for _ in range(PROMPT - PREFIX)]
            out.append(rng.choice(prefixes) + tail)
        else:
            out.append([rng.randrange(2048) for _ in range(PROMPT)])
    return out


def closed_loop(engine: Any, prompts: list[list[int]], concurrency: int) -> dict:
    """Keep ``concurrency`` requests in flight; throughput over the window in which every
    slot stays busy (until the (n - c)-th completion), latency over all requests."""
    from prefill_node.engine.types import PrefillOptions

    done: list[tuple[float, int, int, float]] = []  # (time, input, computed, latency)
    lock, finished = threading.Lock(), threading.Event()
    it = iter(prompts)

    def launch() -> None:
        prompt = next(it, None)
        if prompt is None:
            return
        fut = engine.submit(prompt, PrefillOptions(top_logprobs=1))
        fut.add_done_callback(on_done)

    def on_done(fut) -> None:
        r = fut.result()
        with lock:
            done.append(
                (time.perf_counter(), r.prompt_tokens, r.computed_tokens, r.timings.total_s)
            )
            if len(done) == len(prompts):
                finished.set()
        launch()

    before = engine.stage_stats()
    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(prompts))):
        launch()
    finished.wait()
    wall = time.perf_counter() - t0
    after = engine.stage_stats()
    window = done[: max(1, len(prompts) - concurrency + 1)]
    span = window[-1][0] - t0
    lat = sorted(d[3] for d in done)
    row = {
        "input_tok_s": sum(d[1] for d in window) / span,
        "computed_tok_s": sum(d[2] for d in window) / span,
        "p50_s": lat[len(lat) // 2],
        "p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
        "requests": len(prompts),
    }
    for a, b in zip(before, after, strict=True):
        row[f"busy_stage{a.stage}"] = (b.busy_s - a.busy_s) / wall
        row[f"cpu_stage{a.stage}"] = (b.cpu_s - a.cpu_s) / wall
        # this stage's compute rate while it ran, measured inside the run itself
        row[f"busy_tok_s_stage{a.stage}"] = (b.tokens - a.tokens) / max(b.busy_s - a.busy_s, 1e-9)
    return row


# -- one pipeline per policy, in its own process -------------------------------------------------
def serve_commands(
    conn: Any, engine: Any, handle: Callable[[str, Any], Any], warm: Callable[[], None]
) -> None:
    """The child side of ``PipelineDriver``: run ``warm`` (untimed: first forwards of fresh
    stage processes are slow), reply ready, then reply (True, ``handle(command, args)``) or
    (False, the error) to each (command, args) from ``conn`` until "stop"; finally shut the
    engine down and reply once more."""
    try:
        warm()
        conn.send((True, None))
        while True:
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                conn.send((True, handle(cmd, args)))
            except Exception as exc:  # reported to the bench, which stops the run
                conn.send((False, f"{type(exc).__name__}: {exc}"))
    finally:
        engine.shutdown()
        conn.send((True, None))


def _driver_main(policy: str, conn: Any) -> None:
    """One pipeline of ``policy`` (``serve_commands``): "seed", "cell", "check"."""
    from prefill_node.engine.types import PrefillOptions
    from prefill_node.runtime.dist_env import DistEnv, free_local_port
    from prefill_node.runtime.pipeline_engine import PipelineEngine

    prefixes = shared_prefixes()
    engine = PipelineEngine.start(make_spec(policy), DistEnv(0, 2, "127.0.0.1", free_local_port()))

    def handle(cmd: str, args: Any) -> Any:
        if cmd == "seed":  # the shared prefixes, cached again (untimed)
            for f in [engine.submit(p + [1], PrefillOptions()) for p in prefixes]:
                f.result(timeout=120)
            return None
        if cmd == "cell":
            name, n, seed, c = args
            prompts = prompts_for(workload(name), n, random.Random(seed), prefixes)
            return closed_loop(engine, prompts, c)
        if cmd == "check":
            engine.debug_check_integrity()
            return None
        raise ValueError(f"unknown driver command {cmd!r}")

    def warm() -> None:
        closed_loop(engine, prompts_for(WORKLOADS[0], 8, random.Random(WARMUP_SEED), prefixes), 4)

    serve_commands(conn, engine, handle, warm)


class PipelineDriver:
    """A pipeline led from a child process (``main(*args, conn)`` starts it and answers
    through ``serve_commands``); ``call`` runs one command there. ``name`` labels its
    errors."""

    def __init__(self, name: str, main: Any, *args: Any):
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=main, args=(*args, child), daemon=False)
        self._proc.start()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        self._reply(timeout_s)

    def call(self, cmd: str, *args: Any, timeout_s: float = 1800.0) -> Any:
        self._conn.send((cmd, args))
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(5.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"{self.name} pipeline exited ({self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} pipeline: no answer in {timeout_s:.0f}s")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._proc.join(5.0)
            raise RuntimeError(
                f"{self.name} pipeline process ended (exit code {self._proc.exitcode})"
            ) from None
        if not ok:
            raise RuntimeError(f"{self.name} pipeline: {value}")
        return value

    def stop(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", ()))
                self._conn.poll(60.0)
            except (BrokenPipeError, EOFError, OSError):
                pass
            self._proc.join(30.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def policy_driver(policy: str) -> PipelineDriver:
    """bench/pipeline.py's pipeline of one policy (``_driver_main``)."""
    return PipelineDriver(policy, _driver_main, policy)


# -- ceiling: pure-forward processes on the pipeline's cores ------------------------------------
def _wave_batches(w: Workload):
    """The waves the planner forms at full load: cold = M-token slices of whole prompts;
    warm = the (PROMPT - PREFIX)-token suffixes at offset PREFIX that fit in M."""
    from prefill_node.model.batch import ChunkBatch, ChunkSpec

    table = tuple(range(PROMPT // BLOCK))
    cold = [ChunkBatch((ChunkSpec(s, M, table),)) for s in range(0, PROMPT, M)]
    n = M // (PROMPT - PREFIX)
    warm = [ChunkBatch(tuple(ChunkSpec(PREFIX, PROMPT - PREFIX, table) for _ in range(n)))]
    k = round(w.warm_share * 4)
    return warm * k + cold * (4 - k) if 0 < k < 4 else (warm if k == 4 else cold)


def _forward_worker(
    layers: tuple[int, int],
    threads: int,
    cpus: set[int] | None,
    barrier: Any,
    jobs: Any,
    out: Any,
) -> None:
    """Per job (workload name, seconds): the pure-forward tok/s of ``layers`` on the
    workload's waves with ``threads`` torch threads on ``cpus``, measured in step with the
    other workers behind the same ``barrier``."""
    from prefill_node.model.config import ModelConfig
    from prefill_node.model.paged_kv import PagedKVCache
    from prefill_node.model.partition import LayerRange
    from prefill_node.model.stage_model import StageModel

    torch.set_num_threads(threads)
    if cpus:
        os.sched_setaffinity(0, cpus)
    cfg = ModelConfig.from_hf_config(MODEL, name="bench-tiny")
    model = StageModel.random_init(cfg, LayerRange(*layers), 0)
    kv = PagedKVCache.for_model(cfg, model.layer_range, PROMPT // BLOCK, BLOCK)
    shapes = {}
    for w in WORKLOADS:
        batches = _wave_batches(w)
        inputs = [
            torch.randn(b.total_tokens, cfg.hidden_size)
            if layers[0]
            else torch.randint(0, 2048, (b.total_tokens,))
            for b in batches
        ]
        model(inputs[0], batches[0], kv)  # first call pays one-time costs
        shapes[w.name] = (batches, inputs)
    while True:
        job = jobs.get()
        if job is None:
            return
        name, seconds = job
        batches, inputs = shapes[name]
        barrier.wait()  # the workers behind one barrier measure at the same time
        tokens, i = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            model(inputs[i % len(batches)], batches[i % len(batches)], kv)
            tokens += batches[i % len(batches)].total_tokens
            i += 1
        out.put((name, layers, tokens / (time.perf_counter() - t0)))


@dataclass(frozen=True)
class CeilingRates:
    """Two pure forwards on the cores a pipeline gets (tok/s of whole prompts' tokens):
    ``pair``, each stage slice alone on its stage's core with one thread, concurrently (the
    slower one); ``wide``, the whole model in one process with as many threads as the
    pipeline's stages together (core sharing lends a lone busy stage the idle ones' cores).
    ``best`` is the ceiling: the best pure forward the same cores allow."""

    pair: float
    wide: float

    @property
    def best(self) -> float:
        return max(self.pair, self.wide)


class ForwardCeiling:
    """Three pure-forward processes for bench/pipeline.py's ceiling (``CeilingRates``): one
    per stage slice (each on its stage's core when the machine has them, one thread) and
    one for the whole model on all the pipeline's cores (``core_share``'s budget: one
    thread per stage, at most the cores allowed). ``measure`` runs the pair, then the whole
    model alone."""

    def __init__(self) -> None:
        from prefill_node.runtime.launcher import stage_cpus

        ctx = mp.get_context("spawn")
        cpus = stage_cpus(2)
        allowed = len(os.sched_getaffinity(0))
        wide_threads = max(1, min(allowed, 2))  # CoreShare's budget: base x stages, capped
        # kept: a child unpickles the barrier after start() returns
        self._out, self._barrier, self._alone = ctx.Queue(), ctx.Barrier(2), ctx.Barrier(1)
        self._jobs = [ctx.Queue() for _ in range(3)]
        slices = [((2 * s, 2 * s + 2), 1, {cpus[s]} if cpus else None) for s in range(2)]
        workers = [(*slice_, self._barrier) for slice_ in slices]
        workers.append(((0, 4), wide_threads, set(cpus) if cpus else None, self._alone))
        self._procs = [
            ctx.Process(target=_forward_worker, args=(*w, self._jobs[i], self._out))
            for i, w in enumerate(workers)
        ]
        for p in self._procs:
            p.start()

    def measure(self, name: str, seconds: float) -> CeilingRates:
        for q in self._jobs[:2]:
            q.put((name, seconds))
        pair = min(self._collect(2, seconds))
        self._jobs[2].put((name, seconds))
        (wide,) = self._collect(1, seconds)
        return CeilingRates(pair, wide)

    def _collect(self, n: int, seconds: float) -> list[float]:
        rates: list[float] = []
        deadline = time.monotonic() + seconds + 600
        while len(rates) < n:
            try:
                rates.append(self._out.get(timeout=5.0)[2])
            except queue.Empty:
                dead = [p.exitcode for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ceiling workers failed (exit codes {dead})") from None
        return rates

    def stop(self) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(30.0)
            if p.is_alive():
                p.kill()
