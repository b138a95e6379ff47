"""Publishes a pipeline's KV events: per-stage batches in, aggregated events out to a sink.

The glue between the stages' block pools and whoever tells the router (``KVEventHub.publish``
for ``wavepp serve``). Both engines use it the same way, through ``LeaderEngine``:

- The leader does not read the stages' pools. Each stage drains its own pool
  (``StageAdmission.drain_events()``, pool built with ``events=True``) once per wave,
  AFTER completing the wave's finished requests (their new
  blocks are cached then) and before forwarding the header, and appends
  ``(stage, tuple(events))`` to the wave's header (a field like ``WaveHeader.manifests``);
  the last stage copies the accumulated tuples into its ``WaveResult`` and the leader calls
  ``publish(StageEvents(s, ev) for s, ev in result.kv_events)``. Evictions made while
  admitting (ADMIT rounds) stay buffered in the pool and leave with that stage's next wave,
  so each stage's own order is kept; across stages any order is fine (the aggregator
  publishes the intersection either way). Events are small frozen dataclasses; they pickle
  as they are. Stages with nothing to report send an empty tuple or nothing.

A stage that is restarted empty must be reported with ``AllBlocksCleared`` before its new
events. Not thread-safe: the owner serialises calls. A failing sink is logged and never
fails a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from prefill_node.core.kv_event_aggregator import PipelineKVEventAggregator, StageEvents
from prefill_node.core.kv_events import KVEvent

log = logging.getLogger(__name__)

KVEventSink = Callable[[Sequence[KVEvent]], None]
"""Receives one ordered batch of pipeline-level events; must not block (e.g. KVEventHub.publish)."""


class KVEventFeed:
    """Aggregates ``num_stages`` stages' events and hands non-empty results to ``sink``."""

    def __init__(self, num_stages: int, sink: KVEventSink) -> None:
        self.aggregator = PipelineKVEventAggregator(num_stages)
        self._sink = sink
        self.published_batches = 0
        self.sink_failures = 0

    def publish(self, batches: Iterable[StageEvents]) -> list[KVEvent]:
        """Aggregate and send; the pipeline-level events (possibly none)."""
        events = self.aggregator.ingest_many(batches)
        if events:
            try:
                self._sink(events)
                self.published_batches += 1
            except Exception:
                self.sink_failures += 1
                log.exception("the KV event sink failed; %d events not delivered", len(events))
        return events
