"""The gateway's settings: policy, thresholds, fleet and timing, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from prefill_node.errors import InvalidRequestError

if TYPE_CHECKING:
    from prefill_node.client.prefill_client import ClientTLS


class InvalidGatewayConfigError(InvalidRequestError):
    """A gateway setting is out of range."""


class PrefillMode(Enum):
    """``--prefill``: where a request's prompt is computed."""

    AUTO = "auto"  # per request, by DecisionRule (default)
    REMOTE = "remote"  # always on the prefill tier; tier down -> 503
    LOCAL = "local"  # always on the decode instance (the tier is never asked)


@dataclass(frozen=True)
class DecisionRule:
    """Thresholds of the remote-vs-local rule (``decision.decide``; docs/gateway.md).

    ``local_max_tokens``: decode's prefill budget: a suffix the decode instance would
    compute is computed there while it and the instance's unanswered local prompts stay
    within this many tokens (the tier's fixed cost per request: a gRPC prefill round trip,
    the lease and the NIXL pull, outweighs computing it). Over the budget the predicted
    first tokens decide once the tier's estimated queue exceeds ``max_tier_queue_s``
    (``decision.FirstTokenModel``; below it the tier counts as idle, and the router's
    queue estimate, from polled load, lags by up to a poll); ``decode_prefill_rate`` is that
    model's prior for a decode instance's prefill rate, tokens/s, until one of its streams
    is seen.
    ``request_tokens``: what one running or waiting decode request weighs, in prompt
    tokens, when picking a decode instance (waiting ones count twice).
    """

    local_max_tokens: int = 256
    max_tier_queue_s: float = 2.0
    decode_prefill_rate: float = 5000.0
    request_tokens: int = 256

    def __post_init__(self) -> None:
        if self.local_max_tokens < 0 or self.max_tier_queue_s < 0 or self.request_tokens < 0:
            raise InvalidGatewayConfigError(f"decision thresholds must be >= 0: {self}")
        if not self.decode_prefill_rate > 0:
            raise InvalidGatewayConfigError(f"decode_prefill_rate must be > 0: {self}")


@dataclass(frozen=True)
class GatewayConfig:
    """``served_model``: the name clients put in ``model`` (``/v1/models`` lists it);
    ``router``: the prefill tier's gRPC address (None: no tier, every prompt local), dialled
    with ``router_tls`` (None: plaintext);
    ``max_model_len``: prompt + max_tokens limit, checked before anything is allocated."""

    served_model: str
    max_model_len: int
    router: str | None = None
    router_tls: ClientTLS | None = None
    mode: PrefillMode = PrefillMode.AUTO
    rule: DecisionRule = field(default_factory=DecisionRule)
    score_timeout_s: float = 0.5
    prefill_timeout_s: float = 120.0
    decode_connect_timeout_s: float = 5.0
    decode_poll_s: float = 1.0
    default_max_tokens: int = 16  # vLLM's /v1/completions default

    def __post_init__(self) -> None:
        if not self.served_model or self.max_model_len < 1:
            raise InvalidGatewayConfigError("name the served model and a max_model_len >= 1")
        if self.mode is PrefillMode.REMOTE and self.router is None:
            raise InvalidGatewayConfigError("--prefill remote needs --router HOST:PORT")
        timings = (self.score_timeout_s, self.prefill_timeout_s, self.decode_connect_timeout_s,
                   self.decode_poll_s)  # fmt: skip
        if min(timings) <= 0:
            raise InvalidGatewayConfigError(f"gateway timings must be positive: {timings}")
