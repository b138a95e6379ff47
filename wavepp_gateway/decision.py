"""Remote or local prefill, and which decode instance: the gateway's per-request decision.

Sans-IO: plain values in, a frozen ``Decision`` out, so tests and a simulator drive the same
rule the server runs (docs/gateway.md has the rule and where its thresholds come from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from prefill_node.engine.types import ScoreReport
from wavepp_gateway.config import DecisionRule, PrefillMode


class Reason(Enum):
    """Why ``decide`` chose remote or local."""

    POLICY = "policy"  # --prefill remote|local
    TIER_UNAVAILABLE = "tier_unavailable"  # no answer from the tier, or no ready pipeline
    SHORT_SUFFIX = "short_suffix"  # decode's prefill work with this prompt stays in budget
    DECODE_BUSY = "decode_busy"  # a short suffix, but decode's prefill budget is spent
    TIER_BUSY = "tier_busy"  # the tier's queue is long and the decode instance is not
    LONG_SUFFIX = "long_suffix"  # the tier computes it


@dataclass(frozen=True, slots=True)
class DecodeView:
    """A decode instance as the gateway last saw it: its load (its own ``/metrics``) and
    the prompt's leading tokens its prefix cache holds (from its KV events)."""

    instance: str
    cached_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    max_model_len: int | None = None  # from its /v1/models (None: not known)
    prefilling_tokens: int = 0  # prompt tokens this gateway sent it to compute, no answer yet

    def fits(self, tokens: int) -> bool:
        """True when a request of ``tokens`` (prompt + completion) fits its context."""
        return self.max_model_len is None or tokens <= self.max_model_len


@dataclass(frozen=True, slots=True)
class Decision:
    """``remote``: prefill on the tier; the inputs are kept for the metrics and the log."""

    remote: bool
    reason: Reason
    prompt_tokens: int
    decode: DecodeView
    tier: ScoreReport | None

    @property
    def label(self) -> str:
        return "remote" if self.remote else "local"

    def describe(self) -> str:
        """One line for the debug log: the choice and every input it came from."""
        tier = self.tier
        tier_part = (
            "tier=none"
            if tier is None
            else f"tier={tier.pipeline_id or '-'} cached={tier.cached_tokens} "
            f"queue={tier.queued_s:.3f}s suffix={tier.prefill_s:.3f}s"
        )
        d = self.decode
        return (
            f"prefill={self.label} reason={self.reason.value} prompt={self.prompt_tokens} "
            f"decode={d.instance} decode_cached={d.cached_tokens} running={d.running} "
            f"waiting={d.waiting} prefilling={d.prefilling_tokens} kv={d.kv_usage:.2f} "
            f"{tier_part}"
        )


def pick_decode(
    views: Sequence[DecodeView], rule: DecisionRule, exclude: Sequence[str] = ()
) -> DecodeView | None:
    """The decode instance with the least work ahead for this prompt: its load in
    token-equivalents (``request_tokens`` per running request, twice that per waiting one,
    plus the prompt tokens this gateway sent it to compute that have not answered yet)
    minus the prompt tokens it already caches; ties by fewer waiting, then by id. None when
    no instance is left after ``exclude``."""
    best = None
    for v in views:
        if v.instance in exclude:
            continue
        load = (v.running + 2 * v.waiting) * rule.request_tokens
        load += v.prefilling_tokens - v.cached_tokens
        key = (load, v.waiting, v.instance)
        if best is None or key < best[0]:
            best = (key, v)
    return None if best is None else best[1]


def decide(
    mode: PrefillMode,
    rule: DecisionRule,
    prompt_tokens: int,
    decode: DecodeView,
    tier: ScoreReport | None,
) -> Decision:
    """Remote or local for one prompt on the chosen ``decode`` instance. ``tier`` is the
    router's dry run (None: the tier did not answer). Under ``auto``, with ``suffix`` the
    tokens decode would compute (prompt minus its cached prefix) and ``pending`` the prompt
    tokens this gateway already sent it to compute that have not answered yet:
    no usable tier -> local; ``pending + suffix`` at most ``local_max_tokens`` (decode's
    prefill budget) -> local; the tier's queue over ``max_tier_queue_s`` while decode has
    nothing waiting or pending -> local; a suffix within the budget on its own but not on
    top of ``pending`` -> remote (decode busy: the budget caps the prefill work decode has
    in flight, which is what stalls its running streams); else remote. ``remote`` and
    ``local`` force the choice (the caller answers 503 for remote without a tier)."""
    if mode is not PrefillMode.AUTO:
        return Decision(mode is PrefillMode.REMOTE, Reason.POLICY, prompt_tokens, decode, tier)
    suffix = prompt_tokens - min(decode.cached_tokens, prompt_tokens)
    pending = decode.prefilling_tokens
    budget = rule.local_max_tokens
    tier_busy = tier is not None and tier.queued_s > rule.max_tier_queue_s
    if tier is None or not tier.pipeline_id:
        reason, remote = Reason.TIER_UNAVAILABLE, False
    elif pending + suffix <= budget:
        reason, remote = Reason.SHORT_SUFFIX, False
    elif tier_busy and decode.waiting == 0 and pending == 0:
        reason, remote = Reason.TIER_BUSY, False
    elif suffix <= budget:
        reason, remote = Reason.DECODE_BUSY, True
    else:
        reason, remote = Reason.LONG_SUFFIX, True
    return Decision(remote, reason, prompt_tokens, decode, tier)
