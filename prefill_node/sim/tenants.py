"""Multi-tenant prompt workload: per-tenant system prompts, Zipf popularity, unique suffixes.

T tenants, each with its own system prompt and cache salt (tenants never share blocks); a
request picks a tenant by Zipf popularity over their ranks (rank 0 the most popular) and
appends a unique suffix. A sequence is a pure function of (seed, run), so every routing
policy sees the same requests in the same order. Used by bench/router.py (real pipelines)
and the cluster simulator (``cluster.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantWorkload:
    """Sizes in tokens; ``system_tokens`` / ``suffix_tokens`` are uniform (lo, hi) ranges.

    ``shift_every``: when > 0, the popularity ranking rotates by ``shift_by`` tenants after
    every ``shift_every`` requests (tenant ``k`` has rank ``(k - shift) mod T``), so the hot
    set moves over time; 0 keeps one ranking for the whole run.
    """

    tenants: int
    requests: int
    zipf: float
    system_tokens: tuple[int, int]
    suffix_tokens: tuple[int, int]
    vocab: int
    seed: int = 0
    shift_every: int = 0
    shift_by: int = 1

    def system_prompts(self) -> list[tuple[int, ...]]:
        """Tenant k's system prompt, the same for every run."""
        rng = random.Random(self.seed)
        lo, hi = self.system_tokens
        return [
            tuple(rng.randrange(self.vocab) for _ in range(rng.randint(lo, hi)))
            for _ in range(self.tenants)
        ]

    def prefix_blocks(self, block_size: int) -> int:
        """Full blocks of all the tenants' system prompts (the shareable working set)."""
        return sum(len(s) // block_size for s in self.system_prompts())

    def longest_prompt(self) -> int:
        return self.system_tokens[1] + self.suffix_tokens[1]

    def requests_of_run(self, run: int) -> list[TenantRequest]:
        systems = self.system_prompts()
        rng = random.Random(f"{self.seed}-run-{run}")
        weights = [1 / (rank + 1) ** self.zipf for rank in range(self.tenants)]
        lo, hi = self.suffix_tokens
        out = []
        ranks = rng.choices(range(self.tenants), weights, k=self.requests)
        for i, rank in enumerate(ranks):
            shift = (i // self.shift_every) * self.shift_by if self.shift_every else 0
            tenant = (rank + shift) % self.tenants
            suffix = tuple(rng.randrange(self.vocab) for _ in range(rng.randint(lo, hi)))
            out.append(TenantRequest(tenant, f"tenant-{tenant}", systems[tenant] + suffix))
        return out


@dataclass(frozen=True)
class TenantRequest:
    tenant: int
    salt: str
    tokens: tuple[int, ...]
