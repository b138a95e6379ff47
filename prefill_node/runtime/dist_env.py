"""Where this process sits in a pipeline, parsed once from torchrun-style environment variables."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

from prefill_node.errors import InvalidRequestError

REVISION_ENV = "WAVEPP_PIPELINE_REVISION"


class DistEnvError(InvalidRequestError):
    """RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are missing or inconsistent."""


@dataclass(frozen=True)
class DistEnv:
    """Rank and rendezvous of one stage process.

    ``rank`` is the stage index (0 = leader, which also hosts the rendezvous store at
    ``master_addr:master_port``); ``world_size`` is the number of stages P. The same four
    variables torchrun and Kubernetes (LeaderWorkerSet / StatefulSet ordinal) provide.
    ``revision`` (``WAVEPP_PIPELINE_REVISION``, optional): the deployment revision of this
    process; a stage joins only a leader of the same revision, so an upgrade that rolls leader
    and stage pods separately never runs a pipeline of mixed versions.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    revision: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise DistEnvError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise DistEnvError(f"RANK must be in [0, {self.world_size}), got {self.rank}")
        if not 0 < self.master_port < 65536:
            raise DistEnvError(f"MASTER_PORT must be in (0, 65536), got {self.master_port}")
        if not self.master_addr:
            raise DistEnvError("MASTER_ADDR must name the leader (stage 0) host")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Parse RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a missing one is a DistEnvError."""
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise DistEnvError(
                f"missing environment variable(s) {', '.join(missing)}: a stage needs "
                "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun sets them)"
            )
        return cls(
            rank=_parse_int(env, "RANK"),
            world_size=_parse_int(env, "WORLD_SIZE"),
            master_addr=env["MASTER_ADDR"],
            master_port=_parse_int(env, "MASTER_PORT"),
            revision=env.get(REVISION_ENV, ""),
        )

    def to_env(self) -> dict[str, str]:
        """The variables a child process needs to join as this rank."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            REVISION_ENV: self.revision,
        }

    def with_rank(self, rank: int) -> DistEnv:
        return replace(self, rank=rank)


def _parse_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise DistEnvError(f"{key} must be an integer, got {env[key]!r}") from None


_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()  # this process's picks: never handed out twice


def free_local_port() -> int:
    """A TCP port free right now on every address (for local launches), chosen BELOW the
    kernel's ephemeral range: the kernel gives ports in that range to outgoing connections,
    so one picked there may be taken by a connection before its server binds it. Never the
    same port twice in one process; the kernel's own pick where the range is unknown."""
    try:
        with open(_EPHEMERAL) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()
    for _ in range(64 if low > 2048 else 0):
        port = rng.randrange(max(1024, low // 2), low)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
