"""`pipelines.layout`: podPerStage (a leader pod and stage pods, LWS groups or StatefulSets),
podPerPipeline (one pod running `wavepp serve --stages P`, its stages as child processes on P
GPUs of one node, a Deployment) and `auto`, the default (podPerPipeline where the pipeline's
GPUs fit `maxAcceleratorsPerPod`), rendered and checked against the CLI's own parser."""

from __future__ import annotations

import pytest

from tests.helm_harness import LWS, LWS_API, container_env, merge, parse, render, render_notes

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


def _layout(manifest) -> str:
    return "podPerStage" if manifest.pods_of("stage") else "podPerPipeline"


GPUS = {"pipelines": {"gpus": {"enabled": True}}}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, "podPerPipeline"),  # a CPU pipeline requests no GPU: it fits any node
        ({"pipelines": {"stages": 16}}, "podPerPipeline"),
        (merge(GPUS, {"pipelines": {"stages": 8}}), "podPerPipeline"),  # 8 GPUs: one node
        (merge(GPUS, {"pipelines": {"stages": 9}}), "podPerStage"),  # larger than a node
        (merge(GPUS, {"pipelines": {"stages": 4, "maxAcceleratorsPerPod": 2}}), "podPerStage"),
        (merge(GPUS, {"pipelines": {"stages": 16, "maxAcceleratorsPerPod": 16}}), "podPerPipeline"),
        (LWS, "podPerStage"),  # a pod-per-stage kind asked for by name
        ({"pipelines": {"kind": "StatefulSet"}}, "podPerStage"),
        (merge(GPUS, {"pipelines": {"layout": "podPerPipeline", "stages": 12}}), "podPerPipeline"),
        ({"pipelines": {"layout": "podPerStage"}}, "podPerStage"),
    ],
    ids=[
        "cpu",
        "cpu-16-stages",
        "8-gpus",
        "9-gpus",
        "4-gpus-on-2-gpu-nodes",
        "16-gpu-nodes",
        "kind-lws",
        "kind-sts",
        "forced-per-pipeline",
        "forced-per-stage",
    ],
)
def test_layout_auto_runs_a_pipeline_in_one_pod_where_its_gpus_fit_a_node(values, expected):
    manifest = render(values, api_versions=(LWS_API,))
    assert _layout(manifest) == expected
    if expected == "podPerPipeline":
        (leader,) = manifest.pods_of("leader")
        assert leader.workload["kind"] == "Deployment"
        assert parse(leader.container()).stages == values.get("pipelines", {}).get("stages", 2)
    else:
        assert manifest.all("LeaderWorkerSet") or manifest.all("StatefulSet")
        assert not [
            d for d in manifest.all("Deployment") if d["metadata"]["name"].endswith("-pipeline")
        ]


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ({}, "layout podPerPipeline (auto: a CPU pipeline (gpus.enabled=false) fits one pod)"),
        (
            merge(GPUS, {"pipelines": {"stages": 4}}),
            "layout podPerPipeline (auto: 4 GPUs per pipeline fit "
            "pipelines.maxAcceleratorsPerPod=8)",
        ),
        (
            merge(GPUS, {"pipelines": {"stages": 12}}),
            "layout podPerStage (auto: 12 GPUs per pipeline exceed "
            "pipelines.maxAcceleratorsPerPod=8)",
        ),
        (LWS, "layout podPerStage (auto: pipelines.kind=LeaderWorkerSet is a pod-per-stage kind)"),
        ({"pipelines": {"layout": "podPerStage"}}, "layout podPerStage"),
    ],
    ids=["cpu", "fits", "exceeds", "kind", "explicit"],
)
def test_notes_say_which_layout_auto_chose_and_why(values, line) -> None:
    notes = render_notes(values)
    assert line in [x.strip() for x in notes.splitlines()], notes


def test_the_pod_per_stage_layout_keeps_its_kinds() -> None:
    per_stage = {"pipelines": {"layout": "podPerStage"}}
    assert render(per_stage).pods_of("stage") and render(per_stage).all("StatefulSet")
    assert render(per_stage, api_versions=(LWS_API,)).all("LeaderWorkerSet")
    assert render(LWS).all("LeaderWorkerSet")
