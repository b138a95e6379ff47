"""Benchmark workloads: cold, 90% seeded prefix reuse, mixed 75/25 warm/cold, 4K suffix.

A workload is a deterministic sequence of prompts: the ``j``-th request issued gets prompt
``j`` whatever the policy, so wave and trtllm see exactly the same requests. Warm
prompts start with one of ``num_prefixes`` seeded prefixes (computed into the cache before
the measured run, like a system prompt / shared document warmed by earlier traffic),
followed by fresh tokens; cold prompts are fresh throughout.

Seeded prefixes: as many distinct ones as fit in half of the smallest stage's cache, at
most one per client and at least one; each warm request picks one uniformly at random.
Token ids are drawn from [0, 256) (small ints are shared objects in CPython, which keeps
the cache's collision-guard copies cheap); prompts of different requests still differ
block by block, so nothing is reused by accident.

``token_scale``: one generated id stands for ``token_scale`` real tokens (the core then
runs with blocks of ``block_size / token_scale`` ids). Which blocks are shared, cached,
leased or evicted depends only on block identity, not on how many ids a block has, so
this changes nothing but the simulator's speed (hashing 256K-token prompts on every
stage otherwise dominates). Lengths reported outside (``SimRequest.num_tokens``) are real.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from prefill_node.errors import InvalidRequestError


class InvalidWorkloadError(InvalidRequestError):
    """A workload setting is out of range; the message names it."""


class WorkloadKind(enum.Enum):
    COLD = "cold"  # no reuse
    REUSE = "reuse90"  # every request reuses a seeded prefix of 90% of its length
    MIXED = "mixed"  # 75% of requests as REUSE, 25% as COLD
    SUFFIX = "suffix4k"  # seeded prefix of length - 4096, 4,096 fresh tokens


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload setting; ``num_requests`` requests from ``concurrency`` closed-loop clients."""

    kind: WorkloadKind
    input_len: int
    concurrency: int
    num_requests: int
    block_size: int
    seed: int = 0
    reuse_fraction: float = 0.9
    warm_fraction: float = 0.75
    suffix_tokens: int = 4096
    token_scale: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.num_requests < 1:
            raise InvalidWorkloadError("concurrency and num_requests must be >= 1")
        if self.token_scale < 1 or self.block_size % self.token_scale:
            raise InvalidWorkloadError("token_scale must be >= 1 and divide block_size")
        if self.input_len % self.token_scale or self.suffix_tokens % self.token_scale:
            raise InvalidWorkloadError(
                f"input_len and suffix_tokens must be multiples of token_scale {self.token_scale}"
            )
        if self.input_len < 2 * self.block_size:
            raise InvalidWorkloadError(f"input_len must be >= {2 * self.block_size} tokens")
        if self.kind is WorkloadKind.SUFFIX and self.suffix_tokens >= self.input_len:
            raise InvalidWorkloadError("input_len must exceed the 4K suffix (suffix_tokens)")

    @property
    def prefix_len(self) -> int:
        """Tokens of a warm request's seeded prefix (whole blocks)."""
        if self.kind is WorkloadKind.COLD:
            return 0
        if self.kind is WorkloadKind.SUFFIX:
            raw = self.input_len - self.suffix_tokens
        else:
            raw = int(self.input_len * self.reuse_fraction)
        return raw // self.block_size * self.block_size


@dataclass(frozen=True)
class SimRequest:
    """One prompt of ``num_tokens`` real tokens, ``tokens`` ids (one per ``token_scale``
    tokens), of which the first ``seeded_len`` real tokens were seeded (0 if cold)."""

    request_id: str
    index: int
    tokens: list[int]
    num_tokens: int
    seeded_len: int


class Workload:
    """Generates the seeded prefixes and the ``j``-th prompt of a workload, deterministically."""

    def __init__(self, spec: WorkloadSpec, cache_tokens: int) -> None:
        self.spec = spec
        plen = spec.prefix_len
        if plen:
            fit = cache_tokens // 2 // plen
            self.num_prefixes = max(1, min(spec.concurrency, fit))
        else:
            self.num_prefixes = 0
        rng = np.random.default_rng([spec.seed, 0x5EED])
        ids = plen // spec.token_scale
        self._prefixes = [
            rng.integers(0, 256, ids, dtype=np.int64) for _ in range(self.num_prefixes)
        ]

    def seed_prompts(self) -> list[list[int]]:
        """The prefixes (as ids) to prefill before the measured run (``prefix_len`` tokens each)."""
        return [p.tolist() for p in self._prefixes]

    def request(self, index: int) -> SimRequest:
        """The ``index``-th prompt issued during the run."""
        spec = self.spec
        scale = spec.token_scale
        total = spec.input_len // scale
        rng = np.random.default_rng([spec.seed, 1, index])
        warm = spec.kind in (WorkloadKind.REUSE, WorkloadKind.SUFFIX) or (
            spec.kind is WorkloadKind.MIXED and rng.random() < spec.warm_fraction
        )
        if warm:
            prefix = self._prefixes[int(rng.integers(self.num_prefixes))]
            fresh = rng.integers(0, 256, total - len(prefix), dtype=np.int64)
            tokens = np.concatenate([prefix, fresh]).tolist()
            seeded = len(prefix) * scale
        else:
            tokens = rng.integers(0, 256, total, dtype=np.int64).tolist()
            seeded = 0
        return SimRequest(f"req-{index}", index, tokens, spec.input_len, seeded)
