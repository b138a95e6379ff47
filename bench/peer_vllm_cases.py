"""bench/peer_vllm.py's workload: the cases, their prompts, and the duration estimate.

Every system of a run gets the same prompts (random token ids, a pure function of the case,
the run and the vocabulary); a new run draws new ones, so no run meets a block an earlier run
left in a cache. Shared prefixes are whole multiples of ``ALIGN`` tokens, so both engines can
cache all of it (vLLM's CPU cache uses 128-token blocks, ours 16).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ALIGN = 128  # vLLM's CPU KV block (and a multiple of our 16-token block)
FIRST_ID = 100  # token ids drawn from [FIRST_ID, vocab): no special tokens


@dataclass(frozen=True)
class Case:
    """``prompts`` prompts of ``prompt_tokens`` tokens whose first ``prefix_tokens`` are the same
    for all of them (0: all unique); ``precached``: one prompt with that prefix runs untimed
    first, so the timed prompts find it cached (else they see it first)."""

    name: str
    prompts: int
    prompt_tokens: int
    prefix_tokens: int = 0
    precached: bool = False

    def draw(self, run: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
        """(untimed seed prompts, timed prompts) of ``run``."""
        rng = random.Random(f"{self.name}-{run}")

        def ids(n: int) -> list[int]:
            return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]

        prefix = ids(self.prefix_tokens)
        tail = self.prompt_tokens - self.prefix_tokens
        prompts = [prefix + ids(tail) for _ in range(self.prompts)]
        seed = [prefix + ids(tail)] if self.precached else []
        return seed, prompts

    @property
    def input_tokens(self) -> int:
        return self.prompts * self.prompt_tokens

    @property
    def computed_tokens(self) -> int:
        """Tokens an engine that never computes a cached block twice must compute (the seed
        prompt excluded); one that batches first sights together computes more."""
        if self.prefix_tokens == 0:
            return self.input_tokens
        first = 0 if self.precached else self.prefix_tokens
        return first + self.prompts * (self.prompt_tokens - self.prefix_tokens)


def shared_prefix(prompt_tokens: int, share: float = 0.9) -> int:
    """The longest ALIGN multiple <= ``share`` of the prompt."""
    return int(prompt_tokens * share) // ALIGN * ALIGN


def make_cases(
    prompts: int, prompt_tokens: int, shared_tokens: int, cached_prompts: int, long_tokens: int
) -> tuple[Case, ...]:
    """cold: unique prompts; shared-first: 90% shared prefix seen first in this batch;
    shared-cached: the same shape with the prefix cached beforehand; long: one long prompt."""
    prefix = shared_prefix(shared_tokens)
    return (
        Case("cold", prompts, prompt_tokens),
        Case("shared-first", prompts, shared_tokens, prefix),
        Case("shared-cached", cached_prompts, shared_tokens, prefix, precached=True),
        Case("long", 1, long_tokens),
    )


DEFAULT = dict(prompts=4, prompt_tokens=1024, shared_tokens=1280, cached_prompts=8,
               long_tokens=4096)  # fmt: skip
QUICK = dict(prompts=2, prompt_tokens=256, shared_tokens=640, cached_prompts=2,
             long_tokens=1024)  # fmt: skip

# Rough cost model for the printed estimate only, from the per-core figures measured on this
# machine's cores in 2026-11/12 (float32 / bfloat16 computed tok/s per core at 1K-token prompts);
# a token at context c costs (1 + c / CONTEXT_COST_TOKENS) of a token at context 0; start-ups
# (model load, warm-up, vLLM's torch.compile) in seconds.
RATE_PER_CORE = {
    "float32": {"wavepp": 380.0, "vllm-eager": 290.0, "vllm-compiled": 400.0},
    "bfloat16": {"wavepp": 800.0, "vllm-eager": 870.0, "vllm-compiled": 1170.0},
}
CONTEXT_COST_TOKENS = 8192
STARTUP_S = {"vllm-eager": 40.0, "vllm-compiled": 180.0, "wavepp": 15.0}
SEED_OVERHEAD_S = 1.0  # per case: gRPC round trips, the seed prompt, the client


def case_cost_tokens(case: Case) -> float:
    """Computed tokens weighted by their mean context (a new token's attention reads all
    earlier ones). A first sight counts halfway between ``computed_tokens`` and computing
    the shared prefix once per prompt (engines differ there)."""
    computed = case.computed_tokens
    if case.prefix_tokens and not case.precached:
        computed = (computed + case.input_tokens) / 2
    mean_context = (case.prompt_tokens + case.prefix_tokens) / 2
    return computed * (1 + mean_context / CONTEXT_COST_TOKENS)


def estimate_seconds(
    cases: tuple[Case, ...], systems: list[str], dtypes: list[str], runs: int, cores: int
) -> float:
    """Expected wall time of the whole bench at the cost model's rates (the systems of a dtype
    start in parallel: the slowest start counts)."""
    work = sum(case_cost_tokens(c) for c in cases)
    total = 0.0
    for dtype in dtypes:
        total += max(STARTUP_S.get(s, STARTUP_S["wavepp"]) for s in systems)
        for s in systems:
            rate = RATE_PER_CORE[dtype].get(s, RATE_PER_CORE[dtype]["wavepp"]) * cores
            total += runs * (work / rate + SEED_OVERHEAD_S * len(cases))
    return total
