"""`pipelines.layout`: podPerStage (a leader pod and stage pods, LWS groups or StatefulSets) and
podPerPipeline (one pod running `wavepp serve --stages P`, its stages as child processes on P
GPUs of one node, a Deployment), rendered and checked against the CLI's own parser."""

from __future__ import annotations

import pytest

from tests.helm_harness import LWS, LWS_API, container_env, merge, parse, render

PER_PIPELINE = {"pipelines": {"layout": "podPerPipeline", "replicas": 3, "stages": 4}}
RENDEZVOUS = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WAVEPP_PIPELINE_REVISION"}


@pytest.mark.parametrize("apis", [(), (LWS_API,)], ids=["no-lws", "lws-served"])
def test_pod_per_pipeline_runs_every_stage_in_one_leader_pod(apis) -> None:
    manifest = render(PER_PIPELINE, api_versions=apis)
    assert not manifest.all("StatefulSet") and not manifest.all("LeaderWorkerSet")
    (deployment,) = [
        d for d in manifest.all("Deployment") if d["metadata"]["name"].endswith("-pipeline")
    ]
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    leaders = manifest.pods_of("leader")
    assert len(leaders) == 3 and not manifest.pods_of("stage")
    container = leaders[0].container()
    args = parse(container)
    assert (args.command, args.stages, args.engine) == ("serve", 4, "pipeline")
    # no rendezvous environment: `wavepp serve` launches its stages itself, on loopback
    assert not RENDEZVOUS & container_env(container, leaders[0].name).keys()
    assert {p["name"] for p in container["ports"]} == {"grpc", "metrics"}
    (pipelines_service,) = [
        s for s in manifest.all("Service") if s["metadata"]["name"].endswith("-pipelines")
    ]
    assert manifest.selected_by(pipelines_service) == leaders
    assert {v["name"] for v in leaders[0].spec["volumes"]} >= {"shm", "cache", "tmp"}


def test_pod_per_pipeline_gets_one_gpu_per_stage_and_pod_per_stage_one_per_pod() -> None:
    gpus = {"pipelines": {"gpus": {"enabled": True}}}
    (leader,) = render(merge(PER_PIPELINE, gpus, {"pipelines": {"replicas": 1}})).pods_of("leader")
    limits = leader.container()["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 4 and parse(leader.container()).device == "cuda"
    per_stage = render(merge(LWS, gpus, {"pipelines": {"stages": 4}}))
    for pod in per_stage.pods_of("leader") + per_stage.pods_of("stage"):
        assert pod.container()["resources"]["limits"]["nvidia.com/gpu"] == 1
    (router,) = per_stage.pods_of("router")
    assert "nvidia.com/gpu" not in router.container().get("resources", {}).get("limits", {})


def test_the_pod_per_stage_layout_is_the_default_and_keeps_its_kinds() -> None:
    assert render().pods_of("stage") and render().all("StatefulSet")
    assert render(LWS).all("LeaderWorkerSet")
