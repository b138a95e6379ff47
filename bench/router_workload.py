"""bench/router.py's closed-loop gRPC client over the multi-tenant workload.

The workload itself (``TenantWorkload``: tenants' system prompts, Zipf popularity, unique
suffixes) lives in ``prefill_node/sim/tenants.py``, shared with the cluster simulator.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from tqdm import tqdm

from prefill_node.sim.tenants import TenantRequest, TenantWorkload


@dataclass(frozen=True)
class Outcome:
    """One answered request as the client saw it (``served_by``: set behind a router;
    ``index``: its position in the list the closed loop was given)."""

    index: int
    tenant: int
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    served_by: str
    first_token: int
    top: tuple[tuple[int, float], ...] = ()  # the first position's top (token, logprob)
    fetched_tokens: int = 0  # of cached_tokens, copied from another pipeline first
    fetch_s: float = 0.0  # what that copy took on the pipeline (asking the source, READs)


async def closed_loop(
    client, requests: list[TenantRequest], concurrency: int, tag: str, bar: tqdm
) -> tuple[list[Outcome], float]:
    """Keep ``concurrency`` requests in flight on ``client`` (an AsyncPrefillClient) until
    all are answered (any failure raises); the outcomes in completion order, wall seconds."""
    outcomes: list[Outcome] = []
    todo = iter(enumerate(requests))

    async def worker() -> None:
        for i, req in todo:
            t0 = time.perf_counter()
            remote = await client.prefill(
                list(req.tokens), request_id=f"{tag}-{i}", cache_salt=req.salt
            )
            r = remote.result
            outcomes.append(
                Outcome(i, req.tenant, time.perf_counter() - t0, r.prompt_tokens, r.cached_tokens,
                        r.computed_tokens, r.served_by, r.first_token_id,
                        tuple(r.top_logprobs), r.fetched_tokens, r.timings.fetch_s)
            )  # fmt: skip
            bar.update()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    return outcomes, time.perf_counter() - t0


def run_closed_loop(
    target: str, requests: list[TenantRequest], concurrency: int, tag: str, bar: tqdm
) -> tuple[list[Outcome], float]:
    """``closed_loop`` on a fresh channel to ``target``, in its own event loop."""
    from prefill_node.client.prefill_client import AsyncPrefillClient

    async def main() -> tuple[list[Outcome], float]:
        async with AsyncPrefillClient(target) as client:
            return await closed_loop(client, requests, concurrency, tag, bar)

    return asyncio.run(main())


def latency_stats(outcomes: list[Outcome], wall_s: float) -> dict:
    q = statistics.quantiles([o.latency_s for o in outcomes], n=100, method="inclusive")
    return {"requests": len(outcomes), "p50_s": q[49], "p95_s": q[94],
            "req_s": len(outcomes) / wall_s, "wall_s": wall_s}  # fmt: skip


def token_stats(outcomes: list[Outcome], wall_s: float | None = None) -> dict:
    """Token totals; with ``wall_s`` also input and computed tokens per second."""
    prompt = sum(o.prompt_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes)
    computed = sum(o.computed_tokens for o in outcomes)
    fetches = [o for o in outcomes if o.fetched_tokens]
    fetched = sum(o.fetched_tokens for o in fetches)
    rates = {} if wall_s is None else {"input_tok_s": prompt / wall_s,
                                       "computed_tok_s": computed / wall_s}  # fmt: skip
    return rates | {"input_tokens": prompt, "computed_tokens": computed,
                    "cached_tokens": cached, "cached_share": cached / prompt,
                    "fetched_tokens": fetched, "fetched_share": fetched / prompt,
                    "fetches": len(fetches),
                    "fetch_mean_s": sum(o.fetch_s for o in fetches) / len(fetches)
                    if fetches else 0.0}  # fmt: skip


def placement_stats(outcomes: list[Outcome]) -> dict:
    """``busiest_share``: the busiest pipeline's share of the requests; ``tenant_affinity``:
    the share of requests served by their tenant's most used pipeline (1: every tenant on
    one pipeline; 1/P: spread evenly over P); ``tenant_spread``: the mean number of
    pipelines that served a tenant at least once."""
    per_pipeline = Counter(o.served_by for o in outcomes)
    per_tenant: dict[int, Counter[str]] = defaultdict(Counter)
    for o in outcomes:
        per_tenant[o.tenant][o.served_by] += 1
    home = sum(max(c.values()) for c in per_tenant.values())
    return {
        "busiest_share": max(per_pipeline.values()) / len(outcomes),
        "tenant_affinity": home / len(outcomes),
        "tenant_spread": statistics.fmean(len(c) for c in per_tenant.values()),
    }


def default_num_blocks(
    spec: TenantWorkload, block_size: int, share: float, concurrency: int
) -> int:
    """Blocks per stage of a cluster pipeline: ``share`` of all system-prompt blocks + the
    longest suffixes of concurrency/2 requests in flight."""
    suffix_blocks = math.ceil(spec.suffix_tokens[1] / block_size)
    in_flight = math.ceil(concurrency / 2) * suffix_blocks
    return math.ceil(share * spec.prefix_blocks(block_size)) + in_flight
