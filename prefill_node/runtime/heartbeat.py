"""Liveness of a pipeline's stages through counters in the rendezvous store (skew-free)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from prefill_node.runtime.dist_env import DistEnv


class Heartbeat:
    """Publishes this rank's beat counter and watches the counters it depends on.

    Every ``interval_s`` the rank increments ``wavepp/hb/<rank>`` in the TCPStore hosted by the
    leader. The leader watches every other rank; a worker watches only the leader. A watched
    counter that does not move for ``dead_after_s`` (measured on the local monotonic clock, so
    host clock skew does not matter), or a store that stops answering (the leader hosts it),
    calls ``on_dead(reason)`` once. This catches what process watching cannot: remote pods
    (Kubernetes) and hung-but-alive processes.
    """

    def __init__(
        self,
        env: DistEnv,
        on_dead: Callable[[str], None],
        interval_s: float = 0.25,
        dead_after_s: float = 5.0,
    ):
        self._env = env
        self._on_dead = on_dead
        self._interval_s = interval_s
        self._dead_after_s = dead_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"wavepp-heartbeat-{env.rank}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self._interval_s + 1.0)

    def _watched(self) -> list[int]:
        if self._env.is_leader:
            return list(range(1, self._env.world_size))
        return [0]

    def _run(self) -> None:
        try:
            store = dist.TCPStore(
                self._env.master_addr,
                self._env.master_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=self._dead_after_s),
            )
        except (RuntimeError, ValueError) as exc:
            self._on_dead(f"cannot reach the leader's store: {exc}")
            return
        watched = self._watched()
        last_value = dict.fromkeys(watched, -1)
        last_change = dict.fromkeys(watched, time.monotonic())
        own_key = f"wavepp/hb/{self._env.rank}"
        while not self._stop.wait(self._interval_s):
            try:
                store.add(own_key, 1)
                for rank in watched:
                    value = store.add(f"wavepp/hb/{rank}", 0)
                    if value != last_value[rank]:
                        last_value[rank] = value
                        last_change[rank] = time.monotonic()
            except (RuntimeError, ValueError) as exc:
                if not self._stop.is_set():
                    self._on_dead(f"the leader's store stopped answering: {exc}")
                return
            now = time.monotonic()
            for rank in watched:
                silent = now - last_change[rank]
                if silent > self._dead_after_s:
                    self._on_dead(f"stage {rank} sent no heartbeat for {silent:.1f}s")
                    return
