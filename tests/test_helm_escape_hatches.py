"""The escape hatches operators expect: extra volumes, mounts, init containers, sidecars,
envFrom and scheduling fields per component (and only there), labels and annotations on every
workload, LWS's exclusive-topology annotation and Kueue's queue label, and a `helm test` pod
that can pull the image and be scheduled."""

from __future__ import annotations

import pytest

from tests.helm_harness import LWS, STS, merge, render

WORKLOADS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


def hatches(tag: str) -> dict:
    """Every per-component hatch, each naming ``tag`` so a leak to another component shows."""
    return {
        "labels": {"team": tag},
        "annotations": {"owner": tag},
        "extraVolumes": [{"name": f"{tag}-extra", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": f"{tag}-extra", "mountPath": f"/{tag}"}],
        "extraInitContainers": [{"name": f"{tag}-init", "image": "busybox"}],
        "sidecars": [{"name": f"{tag}-sidecar", "image": "busybox"}],
        "envFrom": [{"secretRef": {"name": f"{tag}-env"}}],
        "runtimeClassName": f"{tag}-runtime",
        "priorityClassName": f"{tag}-priority",
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": f"{tag}/zone", "whenUnsatisfiable": "DoNotSchedule"}
        ],
    }


COMPONENTS = {"leader": "pipelines", "stage": "pipelines", "router": "router", "gateway": "gateway"}
VALUES = {
    "pipelines": hatches("pipelines"),
    "router": hatches("router"),
    "gateway": {**hatches("gateway"), "enabled": True, "decode": {"urls": ["d:8000"]}},
    "commonLabels": {"cost-center": "llm"},
    "commonAnnotations": {"contact": "platform"},
}


PER_PIPELINE = {"pipelines": {"layout": "podPerPipeline"}}
KINDS = {"statefulset": STS, "lws": LWS, "pod-per-pipeline": PER_PIPELINE}


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_each_component_gets_its_own_hatches_and_no_other(kind) -> None:
    manifest = render(merge(kind, VALUES))
    for component, key in COMPONENTS.items():
        pods = manifest.pods_of(component)
        assert pods or (component == "stage" and kind is PER_PIPELINE), component
        for pod in pods:
            spec = pod.spec
            names = [c["name"] for c in spec["containers"]]
            assert names == [component, f"{key}-sidecar"]
            assert spec["initContainers"][-1]["name"] == f"{key}-init"
            main = pod.container(component)
            assert main["envFrom"] == [{"secretRef": {"name": f"{key}-env"}}]
            assert {"name": f"{key}-extra", "mountPath": f"/{key}"} in main["volumeMounts"]
            volumes = {v["name"] for v in spec["volumes"]}
            assert f"{key}-extra" in volumes
            assert not {f"{other}-extra" for other in COMPONENTS.values() if other != key} & volumes
            assert spec["runtimeClassName"] == f"{key}-runtime"
            assert spec["priorityClassName"] == f"{key}-priority"
            assert spec["topologySpreadConstraints"][0]["topologyKey"] == f"{key}/zone"
    for obj in manifest.objects:
        assert obj["metadata"]["labels"]["cost-center"] == "llm", obj["kind"]
    for workload in (o for o in manifest.objects if o["kind"] in WORKLOADS):
        meta = workload["metadata"]
        component = meta["labels"]["app.kubernetes.io/component"]
        key = COMPONENTS[component]
        assert meta["labels"]["team"] == key and meta["annotations"]["owner"] == key
        assert meta["annotations"]["contact"] == "platform"


def test_the_bundled_model_init_container_still_runs_first() -> None:
    (leader,) = render(VALUES).pods_of("leader")
    assert [c["name"] for c in leader.spec["initContainers"]] == [
        "prepare-model",
        "pipelines-init",
    ]


def test_lws_gets_the_exclusive_topology_annotation_and_the_kueue_label() -> None:
    values = {
        "pipelines": {
            "leaderWorkerSet": {"exclusiveTopology": "cloud.provider.com/topology-block"},
            "kueueQueueName": "gpu-queue",
        }
    }
    (lws,) = render(merge(LWS, values)).all("LeaderWorkerSet")
    meta = lws["metadata"]
    assert (
        meta["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"]
        == "cloud.provider.com/topology-block"
    )
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert "wavepp.io/pipeline-revision" in meta["annotations"]
    (plain,) = render(LWS).all("LeaderWorkerSet")
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]
    assert list(plain["metadata"]["annotations"]) == ["wavepp.io/pipeline-revision"]


@pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
def test_every_pipeline_workload_of_every_kind_carries_the_kueue_label(kind) -> None:
    queue = {"pipelines": {"kueueQueueName": "gpu-queue", "replicas": 2, "stages": 3}}
    workloads = [o for o in render(merge(kind, queue)).objects if o["kind"] in WORKLOADS]
    pipeline = [
        w for w in workloads if w["metadata"]["labels"]["app.kubernetes.io/component"] in (
            "leader", "stage")
    ]  # fmt: skip
    expected = {"statefulset": 3, "lws": 1, "pod-per-pipeline": 1}  # STS: leaders + 2 stage sets
    assert len(pipeline) == expected[next(k for k, v in KINDS.items() if v is kind)]
    for workload in workloads:
        labels = workload["metadata"]["labels"]
        assert (labels.get("kueue.x-k8s.io/queue-name") == "gpu-queue") == (workload in pipeline)
    for workload in (o for o in render(kind).objects if o["kind"] in WORKLOADS):
        assert "kueue.x-k8s.io/queue-name" not in workload["metadata"]["labels"]


def test_the_helm_test_pod_can_pull_the_image_and_be_scheduled() -> None:
    values = {
        "imagePullSecrets": [{"name": "regcred"}],
        "helmTest": {
            "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "nodeSelector": {"pool": "cpu"},
        },
    }
    (test_pod,) = [p for p in render(values).all("Pod")]
    spec = test_pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["containers"][0]["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"}}
