"""`pipelines.rdma` and per-component security contexts: RDMA device resources next to the GPU,
IPC_LOCK on the pipeline containers only (never init, router, gateway or test pods), device
paths, NCCL IB variables, the host network with one leader per node (or, pod per pipeline, one
per port slot), and a root variant for pipeline pods alone."""

from __future__ import annotations

import pytest

from tests.helm_harness import LWS, RELEASE, merge, parse, port_number, render, render_result

RDMA = merge(
    LWS,
    {
        "pipelines": {
            "gpus": {"enabled": True},
            "ucx": {"transports": "rc,cuda_copy", "devices": "mlx5_0:1"},
            "rdma": {
                "enabled": True,
                "resources": {"rdma/rdma_shared_device_a": 1},
                "devicePaths": ["/dev/infiniband"],
                "nccl": {"ibHca": "mlx5", "ibGidIndex": "3", "extraEnv": {"NCCL_DEBUG": "WARN"}},
            },
        },
        "gateway": {"enabled": True, "decode": {"urls": ["d:8000"]}},
    },
)
NCCL = {
    "NCCL_IB_DISABLE": "0",
    "NCCL_IB_HCA": "mlx5",
    "NCCL_IB_GID_INDEX": "3",
    "NCCL_DEBUG": "WARN",
}


def _caps(container: dict) -> list[str]:
    return container.get("securityContext", {}).get("capabilities", {}).get("add", [])


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_rdma_reaches_every_pipeline_container_and_nothing_else() -> None:
    manifest = render(RDMA)
    pipeline = manifest.pods_of("leader") + manifest.pods_of("stage")
    for pod in pipeline:
        main = pod.container()
        assert main["resources"]["limits"] == {"nvidia.com/gpu": 1, "rdma/rdma_shared_device_a": 1}
        assert _caps(main) == ["IPC_LOCK"]
        assert main["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert NCCL.items() <= _env(main).items()
        assert _env(main)["UCX_TLS"] == "rc,cuda_copy"
        assert {"name": "rdma-device-0", "mountPath": "/dev/infiniband"} in main["volumeMounts"]
        assert {"name": "rdma-device-0", "hostPath": {"path": "/dev/infiniband"}} in pod.spec[
            "volumes"
        ]
        assert all(not _caps(init) for init in pod.spec["initContainers"])
        assert "hostNetwork" not in pod.spec
    for pod in manifest.pods_of("router") + manifest.pods_of("gateway"):
        for container in pod.spec["containers"] + pod.spec.get("initContainers", []):
            assert not _caps(container) and not NCCL.keys() & _env(container).keys()
        assert "rdma/rdma_shared_device_a" not in str(pod.spec)
    (test_pod,) = manifest.all("Pod")
    assert not _caps(test_pod["spec"]["containers"][0])


def test_without_rdma_nothing_of_it_is_rendered() -> None:
    manifest = render(merge(LWS, {"pipelines": {"rdma": {"resources": {"rdma/x": 1}}}}))
    for pod in manifest.pods_of("leader") + manifest.pods_of("stage"):
        main = pod.container()
        assert not _caps(main) and "NCCL_IB_DISABLE" not in _env(main)
        assert "resources" not in main and "hostNetwork" not in pod.spec


def test_host_network_keeps_one_leader_per_node_unless_affinity_is_given() -> None:
    host = merge(RDMA, {"pipelines": {"rdma": {"hostNetwork": True}, "replicas": 3}})
    manifest = render(host)
    leaders = manifest.pods_of("leader")
    for pod in leaders + manifest.pods_of("stage"):
        assert pod.spec["hostNetwork"] is True
        assert pod.spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    (term,) = leaders[0].spec["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert manifest.matching(term["labelSelector"]) == leaders  # leaders only: their ports
    assert "affinity" not in manifest.pods_of("stage")[0].spec
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}  # fmt: skip
    (leader, *_) = render(merge(host, {"pipelines": {"affinity": own}})).pods_of("leader")
    assert leader.spec["affinity"] == own
    for pod in render(merge(host, {"pipelines": {"rdma": {"hostNetwork": False}}})).pods():
        assert "hostNetwork" not in pod.spec


@pytest.mark.parametrize("layout", [LWS, {"pipelines": {"layout": "podPerPipeline"}}])
def test_host_ipc_gives_pipeline_pods_the_nodes_ipc_and_shm_and_nothing_else(layout) -> None:
    """`pipelines.hostIPC`: the node's IPC namespace and its /dev/shm (the runtime mounts it for
    a host-IPC pod unless a volume covers /dev/shm, so the chart's own shm volume goes)."""
    manifest = render(merge(RDMA, layout, {"pipelines": {"hostIPC": True}}))
    pipeline = manifest.pods_of("leader") + manifest.pods_of("stage")
    assert pipeline
    for pod in pipeline:
        assert pod.spec["hostIPC"] is True
        assert "shm" not in {v["name"] for v in pod.spec["volumes"]}
        assert "/dev/shm" not in {m["mountPath"] for m in pod.container()["volumeMounts"]}
    for pod in manifest.pods_of("router") + manifest.pods_of("gateway"):
        assert "hostIPC" not in pod.spec
    assert "hostIPC" not in manifest.all("Pod")[0]["spec"]  # the helm test pod
    for pod in render(merge(RDMA, layout)).pods():
        assert "hostIPC" not in pod.spec
        if pod.labels["app.kubernetes.io/component"] in ("leader", "stage"):
            assert {"name": "shm", "mountPath": "/dev/shm"} in pod.container()["volumeMounts"]


def test_security_contexts_are_per_component() -> None:
    root = {"runAsUser": 0, "runAsNonRoot": False, "seccompProfile": {"type": "RuntimeDefault"}}
    manifest = render(merge(RDMA, {"pipelines": {"podSecurityContext": root}}))
    for pod in manifest.pods_of("leader") + manifest.pods_of("stage"):
        assert pod.spec["securityContext"] == root
    for pod in manifest.pods_of("router") + manifest.pods_of("gateway"):
        assert pod.spec["securityContext"]["runAsUser"] == 65532
    strict = {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
    }
    (router,) = render({"router": {"securityContext": strict}}).pods_of("router")
    assert router.container()["securityContext"] == strict
    (leader,) = render({"router": {"securityContext": strict}}).pods_of("leader")
    assert leader.container()["securityContext"]["capabilities"] == {"drop": ["ALL"]}


SLOTTED = {
    "pipelines": {
        "layout": "podPerPipeline",
        "replicas": 5,
        "stages": 2,
        "gpus": {"enabled": True},
        "rdma": {"enabled": True, "hostNetwork": True, "portSlots": 3},
    }
}


def test_port_slots_let_pipelines_share_a_node_on_the_host_network() -> None:
    """Slot k's pods listen on the ports + k everywhere the port is named (flags, container
    ports, probes, scrape annotation), one pod of each slot per node, and the Services' named
    target ports reach each pod on its own slot's ports."""
    manifest = render(SLOTTED)
    deployments = {
        d["metadata"]["name"]: d
        for d in manifest.all("Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "leader"
    }
    names = [f"{RELEASE}-wavepp-pipeline", *(f"{RELEASE}-wavepp-pipeline-slot-{k}" for k in (1, 2))]
    assert list(deployments) == names
    assert [d["spec"]["replicas"] for d in deployments.values()] == [2, 2, 1]  # 5 pipelines
    leaders = manifest.pods_of("leader")
    assert len(leaders) == 5 and not manifest.pods_of("stage")
    for k, name in enumerate(names):
        deployment = deployments[name]
        selector = deployment["spec"]["selector"]
        pods = manifest.matching(selector)
        assert {p.workload["metadata"]["name"] for p in pods} == {name}  # no overlap
        for pod in pods:
            container = pod.container()
            assert pod.spec["hostNetwork"] and pod.spec["dnsPolicy"] == "ClusterFirstWithHostNet"
            args = parse(container)
            grpc, metrics = port_number(container, "grpc"), port_number(container, "metrics")
            assert (args.port, args.metrics_port) == (grpc, metrics) == (50051 + k, 9400 + k)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert container[probe]["grpc"]["port"] == grpc
            assert pod.template["metadata"]["annotations"]["prometheus.io/port"] == str(metrics)
            (term,) = pod.spec["affinity"]["podAntiAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            assert manifest.matching(term["labelSelector"]) == pods  # one of ITS slot per node
    service = manifest.one("Service", f"{RELEASE}-wavepp-pipelines")
    assert manifest.selected_by(service) == leaders
    targets = {p["name"]: p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {"grpc": "grpc", "metrics": "metrics"}  # resolved per pod
    ports = {
        (port_number(p.container(), "grpc"), port_number(p.container(), "metrics")) for p in leaders
    }
    assert ports == {(50051 + k, 9400 + k) for k in range(3)}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (merge(SLOTTED, {"pipelines": {"layout": "podPerStage"}}), "needs the podPerPipeline"),
        (
            merge(SLOTTED, {"autoscaling": {"enabled": True, "pipelines": {"provider": "hpa"}}}),
            "one autoscaler cannot scale",
        ),
        (merge(SLOTTED, {"pipelines": {"rdma": {"portSlots": 0}}}), "portSlots"),
    ],
    ids=["pod-per-stage", "autoscaling", "zero"],
)
def test_port_slots_are_refused_where_they_cannot_work(values, message) -> None:
    code, _, err = render_result(values)
    assert code != 0 and message in err, err


def test_one_port_slot_renders_what_the_chart_always_rendered() -> None:
    one = merge(SLOTTED, {"pipelines": {"rdma": {"portSlots": 1}}})
    manifest = render(one)
    (deployment,) = [
        d for d in manifest.all("Deployment") if d["metadata"]["name"].endswith("-pipeline")
    ]
    assert "wavepp.io/port-slot" not in deployment["spec"]["selector"]["matchLabels"]
    assert all(parse(p.container()).port == 50051 for p in manifest.pods_of("leader"))
    # without the host network, slots mean nothing: nothing shares the node's ports
    off = render(merge(SLOTTED, {"pipelines": {"rdma": {"hostNetwork": False}}}))
    assert len([d for d in off.all("Deployment") if "-pipeline" in d["metadata"]["name"]]) == 1
