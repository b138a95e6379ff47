"""DecodeEngine: one DecodeWorker on its own thread, serving many requests at once.

Requests (``DecodeJob``) arrive from any thread. The engine admits them first come, first
served, once its pool holds room for the prompt and for every token the request may still
generate (so a running request never runs out of blocks); gets each prompt's KV, READ over
NIXL from the prefill stages its manifests name, or computed here (local prefill); then
interleaves the running requests' greedy steps, one token each, round robin. A failed KV
load follows ``KVLoadFailurePolicy``: ``recompute`` computes the prompt here, ``fail`` ends
the request with an error (vLLM's ``kv_load_failure_policy``).

Contract: each request's ``sink`` is called on the engine thread, with a ``Token`` per
generated token and then exactly one ``Finished``. The engine frees a request's blocks
exactly once: when it finishes, fails or is cancelled (``cancel``, e.g. a client gone).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kv_transfer import load_trace
from kv_transfer.messages import StageManifest
from kv_transfer.vllm_decode.params import LoadReport
from prefill_node.decode.worker_process import IDLE_POLL_S, DecodeWorkerSpec
from prefill_node.errors import InvalidPromptError, UnavailableError

log = logging.getLogger(__name__)


class KVLoadFailurePolicy(enum.StrEnum):
    """What a request whose KV load failed gets (vLLM's ``kv_load_failure_policy``)."""

    RECOMPUTE = "recompute"  # the prompt is computed here; the answer is the same
    FAIL = "fail"  # the request ends with an error


class Token(NamedTuple):
    token_id: int


class Finished(NamedTuple):
    """The end of a request: ``reason`` is OpenAI's finish_reason ("stop", "length"), or
    "abort" (cancelled) or "error" (``error`` says why). ``load`` is None when the request
    asked for no KV load, else what was READ (``ok`` False when the load failed)."""

    reason: str
    load: LoadReport | None
    error: str | None = None


DecodeEvent = Token | Finished


@dataclass(frozen=True)
class DecodeJob:
    """One request. ``manifests`` None: local prefill; else the prefill stages' leased
    manifests, renamed to ``request_id``. ``refused``: why the load must fail without a READ
    (the prompt is not the one the stages computed)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop_ids: frozenset[int]
    sink: Callable[[DecodeEvent], None]
    manifests: tuple[StageManifest, ...] | None = None
    refused: str | None = None
    traceparent: str = ""  # the caller's trace context: the KV load becomes a span under it


@dataclass
class _Active:
    job: DecodeJob
    need_blocks: int  # prompt + every generated token but the last
    tokens: Generator[int, None, None] | None = None  # while running
    generated: int = 0
    load: LoadReport | None = None
    load_span: Any = None  # the KV load's span while it runs (traced requests)


@dataclass
class DecodeCounters:
    """Cumulative figures (engine thread writes, scrapes read)."""

    prompt_tokens: dict[str, int] = field(
        default_factory=lambda: {"local_compute": 0, "external_kv_transfer": 0}
    )
    generation_tokens: int = 0
    finished: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0}
    )
    kv_loads: dict[str, int] = field(
        default_factory=lambda: {"ok": 0, "failed_recomputed": 0, "failed": 0}
    )


class DecodeLoad(NamedTuple):
    running: int  # generating tokens
    waiting: int  # queued for room, or waiting for their prompt's KV
    used_blocks: int
    num_blocks: int


class DecodeEngine:
    """The worker thread and its request table (``start`` builds the worker there)."""

    def __init__(
        self,
        spec: DecodeWorkerSpec,
        policy: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.counters = DecodeCounters()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[_Active] = deque()  # admitted in this order
        self._loading: dict[str, _Active] = {}
        self._running: dict[str, _Active] = {}
        self._worker: Any = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="decode-engine", daemon=True)

    # ---- any thread ------------------------------------------------------------------

    def start(self, timeout_s: float = 300.0) -> None:
        """Build the worker (model, pool, NIXL agent) on the engine thread; wait for it."""
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._failure is not None:
            raise UnavailableError(f"decode engine did not start: {self._failure!r}")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._worker is not None

    def blocks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        return -(-(prompt_tokens + max_tokens - 1) // self.spec.block_size)

    def check(self, job: DecodeJob) -> int:
        """The blocks ``job`` needs; InvalidPromptError when it could never fit in the pool,
        UnavailableError when the engine is not running."""
        need = self.blocks_needed(len(job.prompt_ids), job.max_tokens)
        if need > self.spec.num_blocks:
            raise InvalidPromptError(
                f"{len(job.prompt_ids)} prompt tokens + {job.max_tokens} new tokens need "
                f"{need} KV blocks; this decode worker has {self.spec.num_blocks} of "
                f"{self.spec.block_size} tokens"
            )
        if not self._thread.is_alive():
            raise UnavailableError("the decode engine is not running")
        return need

    def submit(self, job: DecodeJob) -> None:
        """Queue ``job`` (``check`` first)."""
        self._inbox.put(("submit", _Active(job, self.check(job))))

    def cancel(self, request_id: str) -> None:
        """Stop the request and free its blocks (its sink gets ``Finished("abort")``)."""
        self._inbox.put(("cancel", request_id))

    def load(self) -> DecodeLoad:
        worker = self._worker
        used = worker.used_blocks if worker is not None else 0
        waiting = len(self._waiting) + len(self._loading)
        return DecodeLoad(len(self._running), waiting, used, self.spec.num_blocks)

    def stats(self) -> Any:
        """The worker's blocks in use after its ``check_integrity`` (tests), via the thread."""
        reply: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inbox.put(("stats", reply))
        result = reply.get(timeout=30)
        if isinstance(result, BaseException):
            raise result
        return result

    def stop(self) -> None:
        self._inbox.put(("stop", None))
        self._thread.join(30)

    # ---- engine thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._worker = self.spec.build()
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while self._serve_commands():
                if self._loading:
                    self._worker.pump()
                    self._end_loads()
                self._admit()
                self._step()
        except Exception:
            log.exception("the decode engine failed; every request in it is aborted")
            raise
        finally:
            for active in [*self._waiting, *self._loading.values(), *self._running.values()]:
                self._finish(active, "abort")
            self._worker.close()

    def _serve_commands(self) -> bool:
        """Take the queued commands; block while there is nothing else to do. False: stop."""
        if self._running:
            timeout = 0.0
        elif self._loading:
            timeout = self.spec.poll_period(self._worker.receiver)
        else:
            timeout = IDLE_POLL_S
        while True:
            try:
                cmd, arg = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                return True
            timeout = 0.0
            if cmd == "stop":
                return False
            if cmd == "submit":
                self._waiting.append(arg)
            elif cmd == "cancel":
                self._cancel(arg)
            elif cmd == "stats":
                try:
                    self._worker.check_integrity()
                    arg.put(self._worker.used_blocks)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    arg.put(exc)

    def _cancel(self, request_id: str) -> None:
        for active in self._waiting:
            if active.job.request_id == request_id:
                self._waiting.remove(active)
                self._finish(active, "abort")
                return
        active = self._loading.pop(request_id, None) or self._running.pop(request_id, None)
        if active is not None:
            self._finish(active, "abort")

    def _promised(self) -> int:
        """Blocks admitted requests may still take (need minus what they hold)."""
        active = [*self._loading.values(), *self._running.values()]
        return sum(a.need_blocks - self._worker.held_blocks(a.job.request_id) for a in active)

    def _admit(self) -> None:
        while self._waiting:
            active = self._waiting[0]
            free = self._worker.receiver.free_blocks - self._promised()
            if free < active.need_blocks:
                return
            self._waiting.popleft()
            job = active.job
            try:
                if job.manifests is None:
                    self._start_running(active, self._compute_locally(active))
                    continue
                if job.refused is not None:
                    self._load_failed(active, LoadReport(0, 0, job.refused))
                    continue
                if job.traceparent:
                    active.load_span = load_trace.start_load(
                        job.traceparent, job.request_id, len(job.prompt_ids)
                    )
                try:
                    self._worker.pull_wire(job.request_id, job.prompt_ids, job.manifests)
                except Exception as exc:  # noqa: BLE001 - a refused pull is a failed load
                    self._load_failed(active, LoadReport(0, 0, f"{type(exc).__name__}: {exc}"))
                    continue
                self._loading[job.request_id] = active
            except Exception as exc:  # noqa: BLE001 - a bug: this request ends, others go on
                log.exception("decode request %s failed", job.request_id)
                self._finish(active, "error", f"{type(exc).__name__}: {exc}")

    def _end_loads(self) -> None:
        for request_id in list(self._loading):
            outcome = self._worker.kv_outcome(request_id)
            if outcome is None:
                continue
            active = self._loading.pop(request_id)
            try:
                if not outcome.ok:
                    self._worker.release(request_id)
                    error = f"{type(outcome.error).__name__}: {outcome.error}"
                    self._load_failed(active, LoadReport(0, outcome.num_bytes, error))
                    continue
                self._worker.take_kv(request_id)
                active.load = LoadReport(len(active.job.prompt_ids), outcome.num_bytes)
                load_trace.end_load(active.load_span, outcome.num_bytes, None)
                self.counters.kv_loads["ok"] += 1
                self.counters.prompt_tokens["external_kv_transfer"] += len(active.job.prompt_ids)
                self._start_running(active, self._worker.recompute_last(request_id))
            except Exception as exc:  # noqa: BLE001 - a bug: this request ends, others go on
                log.exception("decode request %s failed", request_id)
                self._finish(active, "error", f"{type(exc).__name__}: {exc}")

    def _load_failed(self, active: _Active, report: LoadReport) -> None:
        active.load = report
        load_trace.end_load(active.load_span, report.num_bytes, report.error)
        log.warning("KV load of %s failed (policy %s): %s", active.job.request_id, self.policy,
                    report.error)  # fmt: skip
        if self.policy is KVLoadFailurePolicy.FAIL:
            self.counters.kv_loads["failed"] += 1
            self._finish(active, "error", f"KV load failed: {report.error}")
            return
        self.counters.kv_loads["failed_recomputed"] += 1
        self._start_running(active, self._compute_locally(active))

    def _compute_locally(self, active: _Active) -> int:
        job = active.job
        first = self._worker.compute_prompt(job.request_id, job.prompt_ids)
        self.counters.prompt_tokens["local_compute"] += len(job.prompt_ids)
        return first

    def _start_running(self, active: _Active, first_token: int) -> None:
        job = active.job
        active.tokens = self._worker.generate(
            job.request_id, first_token, job.max_tokens, tuple(job.stop_ids)
        )
        self._running[job.request_id] = active

    def _step(self) -> None:
        for request_id in list(self._running):
            active = self._running[request_id]
            try:
                token = next(active.tokens)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - a bug: this request ends, others go on
                log.exception("decode request %s failed", request_id)
                del self._running[request_id]
                self._finish(active, "error", f"{type(exc).__name__}: {exc}")
                continue
            active.generated += 1
            self.counters.generation_tokens += 1
            if not self._emit(active, Token(token)):
                del self._running[request_id]
                self._finish(active, "abort")
                continue
            stop = token in active.job.stop_ids
            if stop or active.generated == active.job.max_tokens:
                del self._running[request_id]
                self._finish(active, "stop" if stop else "length")

    def _finish(self, active: _Active, reason: str, error: str | None = None) -> None:
        """Free the request's blocks (if it holds any) and tell its sink."""
        if active.tokens is not None:
            active.tokens.close()
        self._worker.release(active.job.request_id)
        self.counters.finished[reason] += 1
        self._emit(active, Finished(reason, active.load, error))

    def _emit(self, active: _Active, event: DecodeEvent) -> bool:
        """Hand ``event`` to the request's sink; False when the sink failed (its reader is
        gone, e.g. the server's event loop closed): the request is then dropped."""
        try:
            active.job.sink(event)
            return True
        except Exception:  # a sink must not take the engine down
            log.warning("the sink of %s failed", active.job.request_id, exc_info=True)
            return False
