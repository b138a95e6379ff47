"""Autoscaling and disruption: `autoscaling.enabled` leaves `replicas` to the autoscalers, an HPA
scales the router on CPU, a KEDA ScaledObject or an HPA scales the pipelines' scale subresource
on series a leader's /metrics really serves, and a PodDisruptionBudget covers every pipeline
pod."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest

from prefill_node.engine.types import EngineLoad, StageLoad
from prefill_node.server.metrics import ServerMetrics
from tests.helm_harness import LWS, merge, render, render_notes, render_result

PER_PIPELINE = {"pipelines": {"layout": "podPerPipeline"}}
KEDA = {
    "autoscaling": {
        "enabled": True,
        "pipelines": {"provider": "keda", "keda": {"serverAddress": "http://prom:9090"}},
    }
}
HPA = {"autoscaling": {"enabled": True, "pipelines": {"provider": "hpa", "maxReplicas": 6}}}


def _leader_metric_series() -> set[str]:
    """The series names a leader's /metrics serves (the real collector, one stage loaded)."""
    load = EngineLoad(3, 5, 700, (StageLoad(0, 10, 2, 4, 16, busy_fraction=0.5),))
    text = generate_latest(ServerMetrics(load=lambda: load).registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


def _scaled(manifest, kind: str) -> dict:
    (obj,) = [o for o in manifest.all(kind) if o["metadata"]["name"].endswith("-pipeline")]
    return obj


@pytest.mark.parametrize(
    "values, workload",
    [(merge(LWS, HPA), "LeaderWorkerSet"), (merge(PER_PIPELINE, KEDA), "Deployment")],
    ids=["lws-hpa", "pod-per-pipeline-keda"],
)
def test_autoscaling_targets_the_pipelines_scale_subresource_and_omits_replicas(
    values, workload
) -> None:
    manifest = render(values)
    pipelines = _scaled(manifest, workload)
    (router,) = [d for d in manifest.all("Deployment") if d["metadata"]["name"].endswith("-router")]
    assert "replicas" not in pipelines["spec"] and "replicas" not in router["spec"]
    kind = "ScaledObject" if workload == "Deployment" else "HorizontalPodAutoscaler"
    scaler = _scaled(manifest, kind)
    ref = scaler["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == (workload, pipelines["metadata"]["name"])
    assert ref["apiVersion"] == pipelines["apiVersion"]
    (router_hpa,) = [
        h for h in manifest.all("HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"]["name"]
        == router["metadata"]["name"]
    ]  # fmt: skip
    assert router_hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    # the series the autoscaler reads are ones a leader exports
    exported = _leader_metric_series()
    if kind == "ScaledObject":
        queries = [t["metadata"]["query"] for t in scaler["spec"]["triggers"]]
        used = {m for q in queries for m in re.findall(r"\b(wavepp_\w+)\{", q)}
        assert all('stage="0"' in q or "queue_depth" in q for q in queries)
    else:
        used = {m["pods"]["metric"]["name"] for m in scaler["spec"]["metrics"]}
        assert scaler["spec"]["maxReplicas"] == 6
    assert used == {"wavepp_queue_depth", "wavepp_stage_busy_fraction"} and used <= exported


def test_without_autoscaling_replicas_are_rendered_and_no_autoscaler() -> None:
    manifest = render(merge(PER_PIPELINE, {"pipelines": {"replicas": 3}}))
    assert _scaled(manifest, "Deployment")["spec"]["replicas"] == 3
    assert not manifest.all("HorizontalPodAutoscaler") and not manifest.all("ScaledObject")


@pytest.mark.parametrize(
    "values, message",
    [
        (merge({"pipelines": {"kind": "StatefulSet"}}, HPA), "scale as a whole"),
        (
            merge(PER_PIPELINE, {"autoscaling": {"enabled": True}}),
            "autoscaling.pipelines.keda.serverAddress is required",
        ),
    ],
    ids=["statefulset", "keda-without-prometheus"],
)
def test_autoscaling_refuses_what_cannot_scale(values, message) -> None:
    code, _, err = render_result(values)
    assert code != 0 and message in err, err


@pytest.mark.parametrize(
    "values", [LWS, {"pipelines": {"kind": "StatefulSet"}}, PER_PIPELINE],
    ids=["lws", "sts", "per-pipeline"],
)  # fmt: skip
def test_the_pipeline_pdb_covers_every_pipeline_pod_and_nothing_else(values) -> None:
    manifest = render(merge(values, {"pipelines": {"podDisruptionBudget": {"enabled": True}}}))
    (pdb,) = [p for p in manifest.all("PodDisruptionBudget")]
    pipeline_pods = manifest.pods_of("leader") + manifest.pods_of("stage")
    assert manifest.matching(pdb["spec"]["selector"]) == pipeline_pods
    assert pdb["spec"]["maxUnavailable"] == 1


def test_notes_give_the_autoscaled_range_instead_of_replicas() -> None:
    notes = render_notes(merge(PER_PIPELINE, HPA))
    assert "1-6 pipeline(s) (autoscaled, hpa) x 2 stage(s)" in notes, notes
    assert "1 pipeline(s) x 2 stage(s)" in render_notes(PER_PIPELINE)
