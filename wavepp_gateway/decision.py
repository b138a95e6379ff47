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
    TIER_BUSY = "tier_busy"  # over budget, but the tier's queue puts its first token later
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

    def uncached(self, prompt_tokens: int) -> int:
        """The tokens of a ``prompt_tokens``-long prompt it would compute (its suffix)."""
        return prompt_tokens - min(self.cached_tokens, prompt_tokens)

    def fits(self, tokens: int) -> bool:
        """True when a request of ``tokens`` (prompt + completion) fits its context."""
        return self.max_model_len is None or tokens <= self.max_model_len


class FirstTokenModel:
    """Seconds to the first token each way, learned from the streams this gateway relays
    (sans-IO: the request path feeds it, ``decide`` reads it; one per gateway).

    Local: ``(pending + suffix) / rate``, with ``rate`` the decode instance's effective
    prefill rate in tokens/s. A streamed local prefill is a sample ``(pending + suffix) /
    seconds to its first byte``, in the rule's own terms (``pending`` and ``suffix`` as
    ``decide`` saw them), so queueing behind earlier prompts and the slowdown from the
    instance's running streams are both in it. Until an instance has a sample its rate is
    ``rule.decode_prefill_rate``, an optimistic prior on purpose: a rate guessed too low
    would never send a prompt local and so never be corrected.

    Remote: the router's own dry-run estimate (seconds queued ahead + seconds of the
    uncached suffix) plus a learned hand-off, a streamed remote prefill being a sample
    ``seconds to its first byte - (queued + suffix)``: the gRPC round trip, the NIXL pull,
    decode's first step, and whatever the router's cost model misses (0 until a sample).

    Both are exponentially weighted moving averages (``alpha``: a sample's weight)."""

    __slots__ = ("_alpha", "_prior_rate", "_rates", "_handoff_s")

    def __init__(self, rule: DecisionRule, alpha: float = 0.3) -> None:
        self._alpha = alpha
        self._prior_rate = rule.decode_prefill_rate
        self._rates: dict[str, float] = {}
        self._handoff_s: float | None = None

    def rate(self, instance: str) -> float:
        """``instance``'s effective prefill rate, tokens/s (the prior until a sample)."""
        return self._rates.get(instance, self._prior_rate)

    @property
    def handoff_s(self) -> float:
        return self._handoff_s or 0.0

    def local_s(self, decode: DecodeView, suffix: int) -> float:
        return (decode.prefilling_tokens + suffix) / self.rate(decode.instance)

    def remote_s(self, tier: ScoreReport) -> float:
        return max(0.0, tier.queued_s + tier.prefill_s + self.handoff_s)

    def observe_local(self, instance: str, tokens: int, seconds: float) -> None:
        """A streamed local prefill: ``tokens`` = pending + suffix at its decision."""
        if tokens <= 0 or seconds <= 0:
            return
        sample = tokens / seconds
        old = self._rates.get(instance)
        self._rates[instance] = sample if old is None else old + self._alpha * (sample - old)

    def observe_remote(self, tier: ScoreReport, seconds: float) -> None:
        """A streamed remote prefill whose decision saw ``tier``."""
        sample = seconds - tier.queued_s - tier.prefill_s
        old = self._handoff_s
        self._handoff_s = sample if old is None else old + self._alpha * (sample - old)


@dataclass(frozen=True, slots=True)
class Decision:
    """``remote``: prefill on the tier; the inputs are kept for the metrics and the log.
    ``local_s`` / ``remote_s``: the predicted seconds to the first token each way, when the
    rule compared them (None otherwise)."""

    remote: bool
    reason: Reason
    prompt_tokens: int
    decode: DecodeView
    tier: ScoreReport | None
    local_s: float | None = None
    remote_s: float | None = None

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
        predicted = (
            ""
            if self.local_s is None or self.remote_s is None
            else f" first_token_local={self.local_s:.3f}s first_token_remote={self.remote_s:.3f}s"
        )
        return (
            f"prefill={self.label} reason={self.reason.value} prompt={self.prompt_tokens} "
            f"decode={d.instance} decode_cached={d.cached_tokens} running={d.running} "
            f"waiting={d.waiting} prefilling={d.prefilling_tokens} kv={d.kv_usage:.2f} "
            f"{tier_part}{predicted}"
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
    first_token: FirstTokenModel,
) -> Decision:
    """Remote or local for one prompt on the chosen ``decode`` instance. ``tier`` is the
    router's dry run (None: the tier did not answer). Under ``auto``, with ``suffix`` the
    tokens decode would compute (prompt minus its cached prefix) and ``pending`` the prompt
    tokens this gateway already sent it to compute that have not answered yet:
    no usable tier -> local; ``pending + suffix`` at most ``local_max_tokens`` (decode's
    prefill budget) -> local; over the budget, with the tier's queue over
    ``max_tier_queue_s``, local when ``first_token`` predicts decode's first token strictly
    before the tier's (``tier_busy``); else remote (``decode_busy`` for a suffix within the
    budget on its own, ``long_suffix`` otherwise). The budget is the crossover of an idle
    tier and an idle decode instance, so with (about) nothing queued on the tier a prompt
    over it is remote; the predictions only move what queues change. ``remote`` and
    ``local`` force the choice (the caller answers 503 for remote without a tier)."""
    if mode is not PrefillMode.AUTO:
        return Decision(mode is PrefillMode.REMOTE, Reason.POLICY, prompt_tokens, decode, tier)
    suffix = decode.uncached(prompt_tokens)
    if tier is None or not tier.pipeline_id:
        return Decision(False, Reason.TIER_UNAVAILABLE, prompt_tokens, decode, tier)
    if decode.prefilling_tokens + suffix <= rule.local_max_tokens:
        return Decision(False, Reason.SHORT_SUFFIX, prompt_tokens, decode, tier)
    local_s, remote_s = first_token.local_s(decode, suffix), first_token.remote_s(tier)
    if tier.queued_s > rule.max_tier_queue_s and local_s < remote_s:
        reason, remote = Reason.TIER_BUSY, False
    elif suffix <= rule.local_max_tokens:
        reason, remote = Reason.DECODE_BUSY, True
    else:
        reason, remote = Reason.LONG_SUFFIX, True
    return Decision(remote, reason, prompt_tokens, decode, tier, local_s, remote_s)
