"""Cluster simulation: the router's real index and scorer over pipelines' real caches."""

from __future__ import annotations

import json

import pytest

from prefill_node.cli.main import main
from prefill_node.core.hashing import ExtraKeys
from prefill_node.sim.presets import get_preset
from prefill_node.sim.tenants import TenantWorkload
from prefill_router.cluster_sim import ClusterPolicy, ClusterSim, ClusterSpec
from prefill_router.cluster_sim_cli import ZIPF_SWEEP, stops_paying

# zipf 50: rank 0 every time, so the tenant sequence is the rotation alone: 0, 0, 1, 1
TWO_TENANTS = TenantWorkload(
    tenants=2,
    requests=4,
    zipf=50.0,
    system_tokens=(32, 32),
    suffix_tokens=(4, 4),
    vocab=1000,
    shift_every=2,
)


def _run(policy: ClusterPolicy) -> ClusterSim:
    spec = ClusterSpec(get_preset("minimax-pp4"), 2, TWO_TENANTS, clients=1, cache_blocks=64)
    sim = ClusterSim(spec, policy)
    sim.result = sim.run()
    return sim


def test_tenant_mix_rotates_every_shift_every_requests():
    assert [r.tenant for r in TWO_TENANTS.requests_of_run(0)] == [0, 0, 1, 1]
    three = TenantWorkload(3, 8, 50.0, (4, 4), (1, 1), 10, shift_every=2, shift_by=2)
    assert [r.tenant for r in three.requests_of_run(0)] == [0, 0, 2, 2, 1, 1, 0, 0]
    still = TenantWorkload(3, 4, 50.0, (4, 4), (1, 1), 10)
    assert [r.tenant for r in still.requests_of_run(0)] == [0, 0, 0, 0]
    salts = {r.salt for r in three.requests_of_run(0)}
    assert salts == {"tenant-0", "tenant-1", "tenant-2"}  # tenants never share blocks


@pytest.mark.parametrize(
    ("policy", "hits"),
    [
        (ClusterPolicy.PREFIX, 2),  # each tenant's second request finds its prefix
        (ClusterPolicy.PREFIX_ONLY, 2),
        (ClusterPolicy.ORACLE, 2),  # one pooled cache: placement does not matter
        (ClusterPolicy.ROUND_ROBIN, 0),  # p00, p01, p00, p01: every second request elsewhere
        (ClusterPolicy.LEAST_LOADED, 0),  # idle ties go to the pipeline holding fewer blocks
    ],
)
def test_cached_tokens_follow_where_each_policy_routes(policy, hits):
    sim = _run(policy)
    res = sim.result
    # 36-id prompts (9 blocks of 4 ids), a hit reuses the 8 system-prompt blocks; 256 tokens
    # per id
    assert res.cached_share == pytest.approx(hits * 32 / (4 * 36))
    assert (res.requests, res.rejected) == (4, 0)
    miss = sim.stages * sim.cost.chunk_cost(0, 36)
    hit = sim.stages * sim.cost.chunk_cost(32, 4)
    # one client: requests run alone, a request's latency is P x its bottleneck-stage time
    assert res.p95_s == pytest.approx(miss)
    assert res.p50_s == pytest.approx(hit if hits == 2 else miss)
    assert res.input_tok_s == pytest.approx(4 * 36 * 256 / (2 * hit + 2 * miss) if hits else
                                            4 * 36 * 256 / (4 * miss))  # fmt: skip


def test_index_mirrors_every_pipeline_cache_through_kv_events():
    sim = _run(ClusterPolicy.PREFIX)
    for pipe in sim.pipelines:
        stats = pipe.core.stages[0].pool.stats()
        assert sim.router.index.num_blocks(pipe.pid) == stats.cached  # all finished: unpinned
    # p00 holds tenant 0's 8 system blocks + 2 suffix blocks, p01 tenant 1's
    assert [sim.router.index.num_blocks(p.pid) for p in sim.pipelines] == [10, 10]


def test_cluster_cli_runs_every_policy_and_the_zipf_sweep(tmp_path, capsys):
    out, png = tmp_path / "cluster.json", tmp_path / "cluster.png"
    argv = ["sim", "--cluster", "1", "--preset", "minimax-pp4", "--json", str(out)]
    assert main([*argv, "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == len(ZIPF_SWEEP) * len(ClusterPolicy)
    assert {r["policy"] for r in rows} == {p.value for p in ClusterPolicy}
    assert all(r["pipelines"] == 1 and r["rejected"] == 0 for r in rows)
    one = [r for r in rows if r["zipf"] == 1.0 and r["policy"] != "oracle"]
    assert len({r["input_tok_s"] for r in one}) == 1  # one pipeline: routing cannot differ
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "minimax-pp4 N=1" in capsys.readouterr().out
    assert main(["sim", "--cluster", "0"]) == 2


def test_stops_paying_reads_the_sweep():
    from prefill_router.cluster_sim import ClusterResult

    def r(zipf, policy, tok):
        return ClusterResult("p", 8, policy, zipf, 10, 8, 100, tok, tok, 0.5, 1, 2, 0.2, 0)

    rows = [r(0.6, "prefix", 130), r(0.6, "least_loaded", 100), r(0.6, "prefix_only", 140)]
    rows += [r(1.4, "prefix", 104), r(1.4, "least_loaded", 100), r(1.4, "prefix_only", 90)]
    (line,) = stops_paying(rows)
    assert "within 5% of least-loaded from zipf 1.4" in line
    assert "prefix-only behind least-loaded from zipf 1.4" in line


# ---- FETCH: copying a prefix from the pipeline that holds it ------------------------------

# one tenant: a 32-id system prompt (8 blocks) and a long 64-id suffix per request
ONE_TENANT = TenantWorkload(
    tenants=1,
    requests=4,
    zipf=50.0,
    system_tokens=(32, 32),
    suffix_tokens=(64, 64),
    vocab=1000,
)


def _seed_prefix(sim: ClusterSim, pipe: int, ids: int) -> None:
    """Leave the first request's first ``ids`` ids cached on one pipeline (and published)."""
    req = sim.requests[0]
    extra = ExtraKeys(sim.model_id, cache_salt=req.salt)
    sim.pipelines[pipe].core.seed("seed", req.tokens[:ids], extra)
    sim._publish(sim.pipelines[pipe])


def test_fetch_copies_a_busy_holders_prefix_to_the_idle_pipeline():
    """p00 holds the tenant's prefix; two clients: the first request goes to p00 (a hit),
    the second would wait there behind it, so p01 copies the prefix (8 blocks, the link's
    time) and computes only the suffix; from then on both pipelines hold it."""
    spec = ClusterSpec(get_preset("minimax-pp4"), 2, ONE_TENANT, clients=2, cache_blocks=64)
    sim = ClusterSim(spec, ClusterPolicy.FETCH)
    _seed_prefix(sim, 0, 32)
    res = sim.run()  # checks every core's and the index's integrity at the end
    assert (res.requests, res.rejected) == (4, 0)
    assert res.fetched_share * 4 * 96 == pytest.approx(32)  # one copy of the 8 blocks
    assert res.cached_share == pytest.approx(1 / 3)  # every request reused the prefix
    assert res.fetch_mean_s == pytest.approx(sim.fetch_model.fetch_s(8))
    assert res.recompute_mean_s == pytest.approx(sim.cost.chunk_cost(0, 32))
    assert res.fetch_gb_per_request == pytest.approx(8 * sim.block_bytes / 1e9 / 4)
    assert sim.router.transfer is not None and sim.router.transfer.num_samples == 1
    system = sim.router.hashes(sim.requests[0].tokens[:32], sim.requests[0].salt)
    assert sim.router.index.match(system, sim.now, pending=False) == {"p00": 8, "p01": 8}
    prefix = ClusterSim(spec, ClusterPolicy.PREFIX)
    _seed_prefix(prefix, 0, 32)
    assert prefix.run().fetched_share == 0.0  # only FETCH copies


def test_a_copy_whose_source_lost_the_blocks_computes_them_instead():
    from prefill_router.router_core import Placement

    spec = ClusterSpec(get_preset("minimax-pp4"), 2, ONE_TENANT, clients=1, cache_blocks=64)
    sim = ClusterSim(spec, ClusterPolicy.FETCH)
    p00, p01 = sim.pipelines
    req = sim.requests[0]
    request = sim._spec(0, req)
    # routed to p00 with a copy from p01, which holds nothing (evicted since the decision)
    placement = Placement("p00", 1.0, 64, 32, 1.0, "fetch", fetch_from="p01", fetch_blocks=8)
    p00.placements[request.request_id] = placement
    sim._owner[request.request_id] = (p00, 0, 0.0, len(req.tokens))
    sim._fetched(p00, p01, request, placement, 0.0, 0.0)
    assert sim._cached[request.request_id] == 0 and p00.busy  # admitted, computing it all
    assert not sim._copies and request.request_id not in sim._fetches
    assert sim.router.transfer.num_samples == 1  # the failed copy still timed the link
    p00.core.check_integrity()


def test_medians_take_every_figure_over_the_seeds_of_a_cell():
    from prefill_router.cluster_sim import ClusterResult
    from prefill_router.cluster_sim_cli import medians

    def r(policy, tok, seed):
        return ClusterResult("p", 8, policy, 1.0, 10, 8, 100, tok, tok / 2, 0.5, 1, 2, 0.2, 0,
                             fetched_share=tok / 1000, seed=seed)  # fmt: skip

    rows = [r("prefix", 100, 0), r("fetch", 50, 0), r("prefix", 130, 1), r("prefix", 90, 2)]
    prefix, fetch = medians(rows)
    assert (prefix.policy, prefix.input_tok_s, prefix.computed_tok_s) == ("prefix", 100, 50)
    assert (prefix.seed, prefix.fetched_share) == (3, 0.1)  # seed: how many seeds ran
    assert (fetch.policy, fetch.input_tok_s, fetch.seed) == ("fetch", 50, 1)


def test_steady_throughput_stops_when_fewer_requests_than_clients_remain():
    """``steady_input_tok_s`` leaves out the closed loop's drain (fewer requests left than
    clients): with 4 requests and 2 clients it ends at the 3rd completion; the headline
    figure runs to the last."""
    spec = ClusterSpec(get_preset("minimax-pp4"), 2, TWO_TENANTS, clients=2, cache_blocks=64)
    sim = ClusterSim(spec, ClusterPolicy.PREFIX)
    res = sim.run()
    done = sorted(sim._done, key=lambda d: d[1])
    assert len(done) == 4 and res.requests == 4
    assert res.steady_input_tok_s == pytest.approx(sum(d[2] for d in done[:3]) * 256 / done[2][1])
    assert res.input_tok_s == pytest.approx(sum(d[2] for d in done) * 256 / done[3][1])
