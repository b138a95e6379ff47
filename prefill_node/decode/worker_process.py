"""DecodeWorkerProcess: a DecodeWorker in its own OS process, driven over a pipe.

The child owns the NIXL agent, the model and the KV pool; between commands it polls its
receiver, NIXL offering no wake-up on a notification: every ``DecodeWorkerSpec.busy_poll_s``
while a reception is due to end (``KVReceiver.due``: a READ in flight, or a push whose
stages reached the prompt's last token), so its "done" is seen that soon after it arrived;
every ``live_poll_s`` while a streamed push is still some chunks away from its end (parts
land without help, and a fast poll there only takes CPU from prefill stages sharing the
host); every ``IDLE_POLL_S`` otherwise, so an idle worker idles: a command wakes it at once. The
parent handle turns replies back into typed errors; every wait on the child is bounded.
Tokens of ``generate`` stream back one message per token.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kv_transfer.progress import KVProgress
from prefill_node.engine.types import KVPushDestination, StageKVManifest
from prefill_node.errors import (
    InvalidRequestError,
    InvariantError,
    KVHandoffError,
    UnavailableError,
    WaveppError,
)
from prefill_node.model.config import ModelConfig

if TYPE_CHECKING:
    from kv_transfer.receiver import KVReceiver, PartReceived

BUSY_POLL_S = 0.0002
LIVE_POLL_S = 0.002
IDLE_POLL_S = 0.05

_ERRORS: dict[str, type[WaveppError]] = {
    "KVHandoffError": KVHandoffError,
    "InvariantError": InvariantError,
}


@dataclass(frozen=True)
class DecodeWorkerSpec:
    """How the child builds its worker: ``model_dir`` (HF checkpoint), or ``model_config``
    with random weights from ``seed`` (tests)."""

    model_dir: str | None = None
    model_config: ModelConfig | None = None
    seed: int = 0
    num_blocks: int = 256
    block_size: int = 16
    timeout_s: float = 30.0
    kv_progress: KVProgress = KVProgress.EVENT
    busy_poll_s: float = BUSY_POLL_S  # receiver poll period while a reception is due to end
    live_poll_s: float = LIVE_POLL_S  # ... while one is live, further from its end

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.model_config is None):
            raise InvalidRequestError("give exactly one of model_dir and model_config")
        if not 0 < self.busy_poll_s <= self.live_poll_s <= IDLE_POLL_S:
            raise InvalidRequestError(
                f"need 0 < busy_poll_s <= live_poll_s <= {IDLE_POLL_S}, got "
                f"{self.busy_poll_s}, {self.live_poll_s}"
            )

    def poll_period(self, receiver: KVReceiver) -> float:
        """How long the child waits for a command before polling ``receiver`` again."""
        if receiver.due:
            return self.busy_poll_s
        return self.live_poll_s if receiver.busy else IDLE_POLL_S

    def build(self) -> Any:
        from kv_transfer.receiver import ReceiverConfig
        from prefill_node.decode.decode_worker import DecodeWorker

        kw: dict[str, Any] = {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "receiver_config": ReceiverConfig(timeout_s=self.timeout_s),
            "kv_progress": self.kv_progress,
        }
        if self.model_dir is not None:
            return DecodeWorker.from_model_dir(self.model_dir, **kw)
        from prefill_node.model.weights import random_weights

        config = self.model_config
        if config is None:
            raise InvariantError("DecodeWorkerSpec without a model")
        return DecodeWorker.from_weights(config, random_weights(config, self.seed), **kw)


class WorkerStats(NamedTuple):
    used_blocks: int
    ignored_notifications: int


def serve(conn: Any, spec: DecodeWorkerSpec) -> None:
    """Child main: build the worker, answer commands, poll the receiver in between."""
    import time

    worker = spec.build()
    conn.send(("ready", worker.endpoint, worker.agent_name))
    try:
        while True:
            if not conn.poll(spec.poll_period(worker.receiver)):
                worker.pump()
                continue
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            try:
                if cmd == "expect":
                    conn.send(("ok", worker.expect_push(*args)))
                elif cmd == "pull":
                    worker.pull(*args)
                    conn.send(("ok", None))
                elif cmd == "generate":
                    request_id, first, max_new, stop_ids = args
                    try:
                        started = time.monotonic()
                        worker.wait_kv(request_id, spec.timeout_s, spec.busy_poll_s)
                        conn.send(("kv", time.monotonic() - started))
                        for token in worker.generate(request_id, first, max_new, stop_ids):
                            conn.send(("token", token))
                        conn.send(("end", None))
                    finally:
                        worker.release(request_id)
                elif cmd == "release":
                    worker.release(args[0])
                    conn.send(("ok", None))
                elif cmd == "kv_log":
                    worker.pump()
                    log = tuple(worker.receiver.receive_log)
                    conn.send(("ok", (log, dict(worker.ready_at))))
                elif cmd == "stats":
                    worker.pump()
                    worker.check_integrity()
                    stats = WorkerStats(worker.used_blocks, worker.receiver.ignored_notifications)
                    conn.send(("ok", stats))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the parent
                conn.send(("error", type(exc).__name__, str(exc)))
    finally:
        worker.close()


class DecodeWorkerProcess:
    """Parent-side handle of a decode worker process (spawned: no inherited NIXL state)."""

    def __init__(self, spec: DecodeWorkerSpec, start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, spec), daemon=True)
        self.process.start()
        child.close()
        self.timeout_s = spec.timeout_s + 10.0
        _, self.endpoint, self.agent_name = self._recv(start_timeout_s)

    def _recv(self, timeout_s: float) -> tuple:
        if not self._conn.poll(timeout_s):
            raise UnavailableError(f"decode worker did not answer within {timeout_s}s")
        try:
            reply = self._conn.recv()
        except EOFError:
            raise UnavailableError("decode worker process exited") from None
        if reply[0] == "error":
            kind = _ERRORS.get(reply[1], InvalidRequestError if "Invalid" in reply[1] else None)
            raise (kind or UnavailableError)(f"decode worker: {reply[1]}: {reply[2]}")
        return reply

    def _call(self, *cmd: Any) -> Any:
        self._conn.send(cmd)
        return self._recv(self.timeout_s)[1]

    def expect_push(
        self, request_id: str, prompt_ids: Sequence[int], timeout_s: float | None = None
    ) -> KVPushDestination:
        return self._call("expect", request_id, tuple(prompt_ids), timeout_s)

    def pull(
        self, request_id: str, prompt_ids: Sequence[int], manifests: Sequence[StageKVManifest]
    ) -> None:
        self._call("pull", request_id, tuple(prompt_ids), tuple(manifests))

    def generate(
        self, request_id: str, first_token: int, max_new_tokens: int, stop_ids: Sequence[int] = ()
    ) -> Iterator[int]:
        """Wait for the request's KV, then stream its greedy tokens (the first is the
        prefill's). Raises KVHandoffError when the KV never arrived."""
        self._conn.send(("generate", request_id, first_token, max_new_tokens, tuple(stop_ids)))
        self.kv_wait_s = self._recv(self.timeout_s)[1]
        while True:
            kind, value = self._recv(self.timeout_s)
            if kind == "end":
                return
            yield value

    def release(self, request_id: str) -> None:
        self._call("release", request_id)

    def stats(self) -> WorkerStats:
        """Blocks in use and ignored notifications, after the child's check_integrity."""
        return self._call("stats")

    def kv_log(self) -> tuple[tuple[PartReceived, ...], dict[str, float]]:
        """The receiver's streamed-push log, a ``PartReceived`` (request id, stage, end token,
        monotonic time, layer range) per "part" notification, and when each request's KV was
        complete (monotonic)."""
        return self._call("kv_log")

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send(("stop",))
            self.process.join(15)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def __enter__(self) -> DecodeWorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
