"""Chunk cost model: estimated seconds to compute one chunk, from its length and attended context.

A chunk of ``l`` tokens starting at offset ``s`` costs ``a*l + c*l*(s + l/2)``: ``a`` is
the per-token cost of everything but attention (projections, MLP / experts), ``c`` the cost
of one query token attending one context token (causal, so a chunk's tokens attend on
average ``s + l/2`` positions). The cost-aware planner uses it to give every wave about the
same duration; the simulator derives ``a`` and ``c`` from its roofline of the bottleneck
stage, the real runtime can fit them from measured wave times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefill_node.errors import InvalidRequestError


class InvalidCostModelError(InvalidRequestError):
    """Cost coefficients must be finite, non-negative and not both zero."""


@dataclass(frozen=True)
class ChunkCostModel:
    """Seconds per chunk = ``per_token_s * l + per_token_context_s * l * (s + l/2)``."""

    per_token_s: float  # a
    per_token_context_s: float  # c

    def __post_init__(self) -> None:
        a, c = self.per_token_s, self.per_token_context_s
        if not (math.isfinite(a) and math.isfinite(c)) or a < 0 or c < 0 or a + c == 0:
            raise InvalidCostModelError(
                f"chunk cost coefficients must be finite, >= 0 and not both 0, got a={a}, c={c}"
            )

    @classmethod
    def from_flops(
        cls, linear_flops_per_token: float, attention_flops_per_pair: float, flops_per_s: float
    ) -> ChunkCostModel:
        """Compute-bound estimate: every token costs ``linear_flops_per_token`` (projections,
        MLP: about twice the active parameters), every (query, key) pair
        ``attention_flops_per_pair``, at ``flops_per_s``. Only ratios matter to a router
        comparing pipelines of the same model; the absolute scale is a guess."""
        if not flops_per_s > 0:
            raise InvalidCostModelError(f"flops_per_s must be positive, got {flops_per_s}")
        return cls(linear_flops_per_token / flops_per_s, attention_flops_per_pair / flops_per_s)

    def chunk_cost(self, start: int, length: int) -> float:
        """Estimated seconds of tokens ``[start, start + length)``."""
        return length * (self.per_token_s + self.per_token_context_s * (start + length / 2))

    def per_token_cost(self, context: float) -> float:
        """Seconds per token of a chunk whose tokens attend ``context`` positions on average."""
        return self.per_token_s + self.per_token_context_s * context

    def max_length(self, start: int, budget_s: float) -> int:
        """Largest ``l >= 0`` with ``chunk_cost(start, l) <= budget_s`` (not block-aligned)."""
        if budget_s <= 0:
            return 0
        a, c = self.per_token_s, self.per_token_context_s
        lin = a + c * start
        if c == 0:
            return int(budget_s / lin)
        # c/2 l^2 + lin l - budget = 0, positive root; the int() floors, then fix rounding.
        root = (-lin + math.sqrt(lin * lin + 2 * c * budget_s)) / c
        length = max(0, int(root))
        while length > 0 and self.chunk_cost(start, length) > budget_s:
            length -= 1
        while self.chunk_cost(start, length + 1) <= budget_s:
            length += 1
        return length
