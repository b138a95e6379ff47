"""`pipelines.rdma` and per-component security contexts: RDMA device resources next to the GPU,
IPC_LOCK on the pipeline containers only (never init, router, gateway or test pods), device
paths, NCCL IB variables, the host network with one leader per node, and a root variant for
pipeline pods alone."""

from __future__ import annotations

from tests.helm_harness import LWS, merge, render

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
