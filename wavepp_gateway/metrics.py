"""The gateway's Prometheus metrics (``/metrics``), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """Requests by route and outcome, TTFT and end-to-end latency, the prefill decisions
    with their reasons and inputs, tier and decode errors, decode retries, KV loads as
    decode reported them, and each decode instance's last load and indexed prefix blocks."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("wavepp_gateway_requests", "requests answered",
                                ["route", "outcome"], registry=r)  # fmt: skip
        self.ttft = Histogram("wavepp_gateway_ttft_seconds", "request received -> first byte "
                              "of the answer relayed", ["route", "prefill"],
                              buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("wavepp_gateway_e2e_seconds", "request received -> answer done",
                             ["route", "prefill"], buckets=_LATENCY_BUCKETS,
                             registry=r)  # fmt: skip
        self.decisions = Counter("wavepp_gateway_prefill_decisions", "remote vs local prefill",
                                 ["prefill", "reason"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("wavepp_gateway_prompt_tokens", "prompt tokens by where "
                                     "they were prefilled", ["prefill"], registry=r)  # fmt: skip
        self.decision_cached = Counter("wavepp_gateway_decision_cached_tokens", "prompt tokens "
                                       "predicted cached when deciding, on the tier (the "
                                       "router's Score) and on the chosen decode instance",
                                       ["side"], registry=r)  # fmt: skip
        self.tier_queue = Histogram("wavepp_gateway_tier_queue_seconds", "the tier's estimated "
                                    "queue when deciding (the router's Score)",
                                    buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tier_errors = Counter("wavepp_gateway_prefill_errors", "prefill tier failures",
                                   ["status"], registry=r)  # fmt: skip
        self.tier_releases = Counter("wavepp_gateway_prefill_releases", "remote prefills "
                                     "whose KV decode did not use, given back to the tier "
                                     "(outcome: released, or none held)", ["outcome"],
                                     registry=r)  # fmt: skip
        self.decode_errors = Counter("wavepp_gateway_decode_errors", "decode instance failures",
                                     ["instance", "kind"], registry=r)  # fmt: skip
        self.decode_retries = Counter("wavepp_gateway_decode_retries", "requests retried on "
                                      "another decode instance", registry=r)  # fmt: skip
        self.kv_loads = Counter("wavepp_gateway_kv_loads", "KV loads decode reported "
                                "(wavepp_loaded; non-streamed answers)", ["outcome"],
                                registry=r)  # fmt: skip
        self.decode_running = Gauge("wavepp_gateway_decode_running", "vllm:num_requests_running "
                                    "last read", ["instance"], registry=r)  # fmt: skip
        self.decode_waiting = Gauge("wavepp_gateway_decode_waiting", "vllm:num_requests_waiting "
                                    "last read", ["instance"], registry=r)  # fmt: skip
        self.decode_prefilling = Gauge("wavepp_gateway_decode_prefilling_tokens", "prompt "
                                       "tokens sent to the instance to compute that have not "
                                       "answered yet (auto's decode prefill budget)",
                                       ["instance"], registry=r)  # fmt: skip
        self.decode_prefill_rate = Gauge("wavepp_gateway_decode_prefill_rate", "the "
                                         "instance's effective prefill rate, tokens/s, "
                                         "learned from its streamed local prefills (auto's "
                                         "first-token prediction)", ["instance"],
                                         registry=r)  # fmt: skip
        self.tier_handoff = Gauge("wavepp_gateway_tier_handoff_seconds", "first byte of a "
                                  "streamed remote prefill minus the tier's estimate "
                                  "(queued + suffix), learned (auto's first-token "
                                  "prediction)", registry=r)  # fmt: skip
        self.decode_ready = Gauge("wavepp_gateway_decode_ready", "1 while the instance answers",
                                  ["instance"], registry=r)  # fmt: skip
        self.decode_blocks = Gauge("wavepp_gateway_decode_indexed_blocks", "prefix blocks "
                                   "indexed from the instance's KV events", ["instance"],
                                   registry=r)  # fmt: skip

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
