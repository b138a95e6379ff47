"""Benchmark: the cluster router's sans-IO core - index ingestion and one routing decision.

(a) Ingestion: ``blocks`` fresh block hashes arrive as BlockStored chains (64 blocks per
event, 16 events per batch) spread over 4 pipelines, then leave as BlockRemoved; rate in
blocks per CPU second (one core: the index is plain Python, no threads).
(b) One routing decision for a 32K-token prompt over 4 pipelines holding ``resident``
blocks in all: chained hashing (``hash_block_tokens``, 16-token blocks, ExtraKeys), the
index match, the PREFIX scorer; and ``record_pending`` of the prompt's blocks after it.
The prompt's first 24K tokens are resident on p1, its first 8K on p2, its first 4K pending
on p3.
Reported: median over ``runs`` runs of the per-run mean (CPU time, since a shared
machine's load swings wall time).

    python bench/router_core.py --json /tmp/router_core.json [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from prefill_node.core.cost_model import ChunkCostModel
from prefill_node.core.hashing import BlockHash, ExtraKeys, hash_block_tokens
from prefill_node.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefill_router.index import GlobalPrefixIndex
from prefill_router.scoring import PipelineView, Scorer

BLOCK_SIZE = 16
PIPELINES = ("p0", "p1", "p2", "p3")
CHAIN = 64  # blocks per BlockStored event
BATCH = 16  # events per batch
PROMPT_TOKENS = 32 * 1024
COST = ChunkCostModel(per_token_s=2e-5, per_token_context_s=1e-9)  # an 8B-class guess


def random_chains(rng: random.Random, blocks: int) -> list[tuple[BlockHash, ...]]:
    """Fresh 64-bit hashes cut into chains (the index never looks inside a hash)."""
    hashes = [BlockHash(rng.getrandbits(64)) for _ in range(blocks)]
    return [tuple(hashes[i : i + CHAIN]) for i in range(0, blocks, CHAIN)]


def subscribed_index(extra: dict[str, list[KVEvent]] | None = None) -> GlobalPrefixIndex:
    index = GlobalPrefixIndex()
    for pid in PIPELINES:
        index.add_pipeline(pid)
        index.apply(pid, 1, [AllBlocksCleared(), *(extra or {}).get(pid, [])])
    return index


def ingest_once(chains: list[tuple[BlockHash, ...]]) -> tuple[float, float]:
    """CPU seconds to store, then to remove, every chain (round-robin over pipelines)."""
    index = subscribed_index()
    stores = [BlockStored(c, None, (), BLOCK_SIZE) for c in chains]
    removes = [BlockRemoved(c) for c in chains]
    seq = dict.fromkeys(PIPELINES, 1)
    times = []
    for events in (stores, removes):
        batches = [events[i : i + BATCH] for i in range(0, len(events), BATCH)]
        t0 = time.process_time()
        for i, batch in enumerate(batches):
            pid = PIPELINES[i % len(PIPELINES)]
            seq[pid] += 1
            index.apply(pid, seq[pid], batch)
        times.append(time.process_time() - t0)
    if index.num_blocks() != 0:
        raise RuntimeError("ingestion benchmark left blocks behind")
    return times[0], times[1]


def routing_setup(resident: int, rng: random.Random):
    """An index with ``resident`` blocks over 4 pipelines and a 32K prompt partly cached."""
    extra = ExtraKeys("bench-model", cache_salt="tenant-1")
    tokens = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    hashes = hash_block_tokens(tokens, BLOCK_SIZE, extra)
    hits = {"p1": hashes[: 24 * 1024 // BLOCK_SIZE], "p2": hashes[: 8 * 1024 // BLOCK_SIZE]}
    per_pipeline = (resident - sum(len(h) for h in hits.values())) // len(PIPELINES)
    feeds: dict[str, list[KVEvent]] = {}
    for pid in PIPELINES:
        filler = [BlockStored(c, None, (), BLOCK_SIZE) for c in random_chains(rng, per_pipeline)]
        prefix = [BlockStored(hits[pid], None, (), BLOCK_SIZE)] if pid in hits else []
        feeds[pid] = prefix + filler
    index = subscribed_index(feeds)
    views = [
        PipelineView(pid, True, 0.05 * i, 131_072, 65_536, i) for i, pid in enumerate(PIPELINES)
    ]
    return index, tokens, extra, views


def route_once(index, tokens, extra, views, repeats: int, start: float) -> dict[str, float]:
    """Mean CPU seconds per step of ``repeats`` routing decisions, 3 s apart from ``start``
    (so each starts with the previous one's pending entries expired, and p3's fresh)."""
    scorer = Scorer(COST, BLOCK_SIZE)
    p3_pending = hash_block_tokens(tokens[: 4 * 1024], BLOCK_SIZE, extra)
    spent = dict.fromkeys(("hash", "match", "choose", "record_pending"), 0.0)
    for i in range(repeats):
        now = start + 3.0 * i
        index.expire(now)
        index.record_pending("p3", p3_pending, now)
        t0 = time.process_time()
        hashes = hash_block_tokens(tokens, BLOCK_SIZE, extra)
        t1 = time.process_time()
        matched = index.match(hashes, now)
        t2 = time.process_time()
        decision = scorer.choose(len(tokens), matched, views)
        t3 = time.process_time()
        index.record_pending(decision.pipeline, hashes, now)
        t4 = time.process_time()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[key] += dt
        expected = {"p0": 0, "p1": 1536, "p2": 512, "p3": 256}
        if decision.pipeline != "p1" or matched != expected:
            raise RuntimeError(f"unexpected routing: {decision.pipeline}, {matched}")
    return {k: v / repeats for k, v in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write the rows here")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=500_000, help="blocks ingested per run")
    ap.add_argument("--resident", type=int, default=200_000, help="blocks in the index")
    ap.add_argument("--repeats", type=int, default=20, help="routing decisions per run")
    args = ap.parse_args()
    rng = random.Random(0)
    chains = random_chains(rng, args.blocks)
    index, tokens, extra, views = routing_setup(args.resident, rng)
    stores, removes, steps = [], [], []
    for run in tqdm(range(args.runs), desc="runs"):
        store_s, remove_s = ingest_once(chains)
        stores.append(args.blocks / store_s)
        removes.append(args.blocks / remove_s)
        steps.append(route_once(index, tokens, extra, views, args.repeats, 1e4 * (run + 1)))
    med = {k: statistics.median(s[k] for s in steps) * 1e3 for k in steps[0]}
    total = statistics.median(s["hash"] + s["match"] + s["choose"] for s in steps) * 1e3
    rows = [
        ("ingest_block_stored", statistics.median(stores), "blocks/s"),
        ("ingest_block_removed", statistics.median(removes), "blocks/s"),
        ("route_32k_hash", med["hash"], "ms"),
        ("route_32k_match", med["match"], "ms"),
        ("route_32k_choose_4_pipelines", med["choose"], "ms"),
        ("route_32k_total", total, "ms"),
        ("record_pending_32k", med["record_pending"], "ms"),
        ("index_resident_blocks", index.num_blocks(), "blocks"),
    ]
    out = [{"metric": m, "value": round(v, 4), "unit": u, "runs": args.runs} for m, v, u in rows]
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'metric':<30} {'value':>14}  unit")
    for row in out:
        print(f"{row['metric']:<30} {row['value']:>14,.4f}  {row['unit']}")


if __name__ == "__main__":
    main()
