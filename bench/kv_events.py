"""Benchmark: cost of the pipeline's KV-event path per request, by pipeline depth.

A synthetic churn: ``chains`` prompts of ``blocks`` full blocks each are stored on every
stage, then evicted (tail first), as per-stage batches the way ``LocalEngine`` feeds them.
Two sides per depth, timed in one run: the ``PipelineKVEventAggregator`` alone, and the
aggregator plus ``KVEventHub.publish`` (its snapshot mirror, no subscribers) - what
``wavepp serve`` pays. Reported: median CPU time of ``runs`` runs per request (store +
evict of one prompt) and the ratio to one stage. CPU time, because a shared machine's load
swings wall time.

    python bench/kv_events.py --json /tmp/kv_events.json [--runs 5] [--chains 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from prefill_node.core.kv_event_aggregator import PipelineKVEventAggregator, StageEvents
from prefill_node.core.kv_events import BlockRemoved, BlockStored, KVEvent
from prefill_node.server.kv_event_hub import KVEventHub

BLOCK_SIZE = 16


def churn(chains: int, blocks: int) -> list[KVEvent]:
    """One stage's feed: every prompt stored, then every prompt evicted tail first."""
    tokens = tuple(range(blocks * BLOCK_SIZE))
    base = [range(c * blocks, (c + 1) * blocks) for c in range(chains)]
    stored = [BlockStored(tuple(b), None, tokens, BLOCK_SIZE) for b in base]
    removed = [BlockRemoved(tuple(reversed(b))) for b in base]
    return [*stored, *removed]


def run_once(stages: int, feed: list[KVEvent], with_hub: bool) -> float:
    agg = PipelineKVEventAggregator(stages)
    hub = KVEventHub("bench")
    t0 = time.process_time()
    for event in feed:
        out = agg.ingest_many(StageEvents(s, (event,)) for s in range(stages))
        if with_hub:
            hub.publish(out)
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write the rows here")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--chains", type=int, default=2000, help="prompts per run")
    ap.add_argument("--blocks", type=int, default=16, help="full blocks per prompt")
    ap.add_argument("--stages", default="1,2,4,8", help="pipeline depths to compare")
    args = ap.parse_args()
    feed = churn(args.chains, args.blocks)
    depths = [int(x) for x in args.stages.split(",")]
    cells = [(p, hub) for p in depths for hub in (False, True)]
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in cells}
    for _ in tqdm(range(args.runs), desc="runs"):
        for cell in cells:  # interleaved: background load hits every cell alike
            times[cell].append(run_once(cell[0], feed, cell[1]))
    rows = []
    for p, hub in cells:
        per_request_us = statistics.median(times[(p, hub)]) / args.chains * 1e6
        base_us = statistics.median(times[(depths[0], hub)]) / args.chains * 1e6
        rows.append(
            {
                "stages": p,
                "side": "aggregator+hub" if hub else "aggregator",
                "blocks_per_request": args.blocks,
                "runs": args.runs,
                "cpu_us_per_request": round(per_request_us, 1),
                "ratio_vs_first_depth": round(per_request_us / base_us, 2),
            }
        )
    for row in rows:
        print(
            f"P={row['stages']:<2} {row['side']:<15} {row['cpu_us_per_request']:>8.1f} us/request"
            f"  x{row['ratio_vs_first_depth']}"
        )
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
