"""Local launch: the leader spawns stages 1..P-1 as child processes and watches them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from prefill_node import tracing
from prefill_node.mkl_vendor import preload_env
from prefill_node.runtime.core_share import FD_ENV, CoreBoard
from prefill_node.runtime.dist_env import DistEnv

STAGE_CPU_ENV = "WAVEPP_STAGE_CPU"


def stage_cpus(world_size: int) -> list[int] | None:
    """One core per stage (stage s on the s-th allowed core) when there are enough, else None."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) < world_size:
        return None
    return allowed[:world_size]


def pin_to_cpu(cpu: int | None) -> None:
    """Pin this process to one core (no-op when None or unsupported)."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


class LocalLauncher:
    """Starts one OS process per non-leader stage, with torchrun-style environment.

    Each child runs ``python -m prefill_node.runtime.stage_main`` (what ``wavepp stage`` runs in
    a pod) with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, one thread of torch, and its
    own core when the machine has at least P cores - unless the stages share cores (``board``,
    a ``CoreBoard`` whose descriptor each child inherits: runtime/core_share.py), then the OS
    places them. A watcher thread calls ``on_exit(rank, returncode)`` once for the first
    child that exits while the launcher is not stopping - the engine turns that into
    "pipeline unavailable" within one poll interval.
    """

    def __init__(
        self,
        env: DistEnv,
        on_exit: Callable[[int, int], None],
        pin_cpus: bool = True,
        poll_s: float = 0.1,
        board: CoreBoard | None = None,
    ):
        self._env = env
        self._on_exit = on_exit
        self._pin_cpus = pin_cpus and board is None  # shared cores: the OS places the threads
        self._board = board
        self._poll_s = poll_s
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="wavepp-launcher", daemon=True)

    @property
    def pids(self) -> dict[int, int]:
        """Stage rank -> OS pid of its process."""
        return {rank: p.pid for rank, p in self._procs.items()}

    def exit_summary(self, wait_s: float = 0.5) -> str:
        """'stage R exited with code C' for every child that exited, else '' - waiting up
        to ``wait_s`` for one: a dying process closes its sockets (peers see the error)
        before it can be reaped."""
        deadline = time.monotonic() + wait_s
        while True:
            codes = {rank: p.poll() for rank, p in self._procs.items()}
            dead = [f"stage {r} exited with code {c}" for r, c in codes.items() if c is not None]
            if dead or time.monotonic() >= deadline:
                return ", ".join(dead)
            time.sleep(0.02)

    def start(self) -> None:
        cpus = stage_cpus(self._env.world_size) if self._pin_cpus else None
        for rank in range(1, self._env.world_size):
            env = preload_env(dict(os.environ))  # MKL's fast kernels on AMD (mkl_vendor.py)
            env.update(self._env.with_rank(rank).to_env())
            env["OMP_NUM_THREADS"] = "1"
            env.update(tracing.child_env())  # the leader's --otlp-endpoint
            env.pop(STAGE_CPU_ENV, None)
            if cpus is not None:
                env[STAGE_CPU_ENV] = str(cpus[rank])
            env.pop(FD_ENV, None)
            fds: tuple[int, ...] = ()
            if self._board is not None:
                env[FD_ENV], fds = self._board.seat(rank), (self._board.fd,)
            self._procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "prefill_node.runtime.stage_main"], env=env, pass_fds=fds
            )
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(self._poll_s):
            for rank, proc in self._procs.items():
                code = proc.poll()
                if code is not None and not self._stopping.is_set():
                    self._on_exit(rank, code)
                    return

    def stop(self, grace_s: float = 5.0) -> dict[int, int]:
        """Wait up to ``grace_s`` for children to exit on their own, then terminate, then kill.

        Returns each rank's exit code.
        """
        self._stopping.set()
        codes: dict[int, int] = {}
        for rank, proc in self._procs.items():
            try:
                codes[rank] = proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    codes[rank] = proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes[rank] = proc.wait()
        return codes
