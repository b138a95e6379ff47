"""A small threaded Engine for the gRPC tests: real block accounting, deterministic tokens.

Each request holds ceil(n / block_size) blocks on every stage from admission until it
finishes or is aborted; a worker thread "computes" for ``compute_s`` per request. Used only
until / where the real LocalEngine cannot give controllable timing.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from prefill_node.engine.types import (
    CacheIdentity,
    EngineHealth,
    EngineLoad,
    PrefillOptions,
    PrefillResult,
    PrefillTimings,
    StageKVManifest,
    StageLoad,
)
from prefill_node.errors import (
    InvalidPromptError,
    NeverFitsError,
    RequestAbortedError,
    UnavailableError,
)


def expected_first_token(token_ids: Sequence[int], vocab_size: int) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % vocab_size


class ToyEngine:
    def __init__(
        self,
        *,
        stages: int = 2,
        num_blocks: int = 64,
        block_size: int = 4,
        vocab_size: int = 100,
        max_model_len: int = 128,
        compute_s: float = 0.0,
    ) -> None:
        self.stages = stages
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._vocab = vocab_size
        self._max_len = max_model_len
        self.compute_s = compute_s
        self._lock = threading.Condition()
        self._held: dict[str, int] = {}  # request id -> blocks held on each stage
        self._queue: deque[tuple[str, tuple[int, ...], PrefillOptions, Future, float]] = deque()
        self._futures: dict[str, Future] = {}
        self._dead = False
        self._stop = False
        self._worker = threading.Thread(target=self._run, daemon=True)
        self._worker.start()

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @property
    def cache_identity(self) -> CacheIdentity:
        return CacheIdentity("toy|float32", self.block_size)

    def submit(self, token_ids: Sequence[int], options: PrefillOptions) -> Future[PrefillResult]:
        if not token_ids:
            raise InvalidPromptError("empty prompt")
        need = math.ceil(len(token_ids) / self.block_size)
        if need > self.num_blocks:
            raise NeverFitsError(f"needs {need} blocks, a stage has {self.num_blocks}")
        future: Future[PrefillResult] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._dead:
                raise UnavailableError("stage 1 is down")
            rid = options.request_id
            self._futures[rid] = future
            self._queue.append((rid, tuple(token_ids), options, future, time.monotonic()))
            self._lock.notify_all()
        return future

    def abort(self, request_id: str) -> bool:
        with self._lock:
            future = self._futures.pop(request_id, None)
            if future is None:
                return False
            self._queue = deque(q for q in self._queue if q[0] != request_id)
            self._held.pop(request_id, None)
            self._lock.notify_all()
        future.set_exception(RequestAbortedError(f"request {request_id} was aborted"))
        return True

    def kill_stage(self) -> None:
        with self._lock:
            self._dead = True
            failed = list(self._futures.values())
            self._futures.clear()
            self._queue.clear()
            self._held.clear()
        for f in failed:
            f.set_exception(UnavailableError("stage 1 died"))

    def used_blocks(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def check_integrity(self) -> None:
        with self._lock:
            used = sum(self._held.values())
            if not 0 <= used <= self.num_blocks or set(self._held) - set(self._futures):
                raise AssertionError(f"block accounting broken: {used} used, {self._held}")

    def load(self) -> EngineLoad:
        with self._lock:
            used = sum(self._held.values())
            stages = tuple(
                StageLoad(s, self.num_blocks - used, 0, used, self.num_blocks)
                for s in range(self.stages)
            )
            tokens = sum(len(q[1]) for q in self._queue)
            return EngineLoad(len(self._queue), len(self._futures), tokens, stages)

    def health(self) -> EngineHealth:
        with self._lock:
            if self._dead:
                return EngineHealth(live=True, ready=False, detail="stage 1 is down")
            return EngineHealth(live=True, ready=True)

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._worker.join(5)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._lock.wait()
                if self._stop:
                    return
                rid, ids, options, future, submitted = self._queue.popleft()
                need = math.ceil(len(ids) / self.block_size)
                while sum(self._held.values()) + need > self.num_blocks and rid in self._futures:
                    self._lock.wait(0.01)
                if rid not in self._futures:
                    continue
                self._held[rid] = need
            end = time.monotonic() + self.compute_s
            with self._lock:
                while rid in self._futures and not self._stop:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(left)
                if self._futures.pop(rid, None) is None:
                    continue  # aborted while computing: abort freed the blocks
                self._held.pop(rid, None)
            future.set_result(self._result(rid, ids, options, submitted))

    def _result(self, rid, ids, options, submitted) -> PrefillResult:
        first = expected_first_token(ids, self._vocab)
        top = tuple(
            ((first + k) % self._vocab, -0.5 * (k + 1)) for k in range(options.top_logprobs)
        )
        blocks = tuple(range(math.ceil(len(ids) / self.block_size)))
        manifests = tuple(
            StageKVManifest(s, s, s + 1, blocks, self.block_size, len(ids), 2, 8, "float32")
            for s in range(self.stages)
        )
        total = time.monotonic() - submitted
        return PrefillResult(
            rid, first, top, len(ids), 0, len(ids), PrefillTimings(total_s=total), manifests
        )
