"""Render tests of helm/wavepp's network and device values: the NetworkPolicy selects exactly
the pods and ports it means, UCX settings reach every pipeline container only when set, and
GPUs give every stage pod one device, cuda and shared memory."""

from __future__ import annotations

import pytest

from tests.helm_harness import (
    LWS,
    NETPOL,
    STS,
    container_env,
    merge,
    parse,
    pod_volume,
    port_number,
    render,
    selects,
)


def _rule_from(policy: dict, predicate) -> dict:
    (rule,) = [r for r in policy["spec"]["ingress"] if any(predicate(p) for p in r["from"])]
    return rule


@pytest.mark.parametrize("values", [STS, LWS], ids=["statefulset", "lws"])
def test_network_policy_admits_the_router_the_pipelines_the_decode_fleet_and_prometheus(
    values,
) -> None:
    manifest = render(merge(values, NETPOL, {"pipelines": {"replicas": 2, "stages": 3}}))
    policy = manifest.one("NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress: KV pushes to decode stay open
    pipeline_pods = manifest.pods_of("leader") + manifest.pods_of("stage")
    assert len(pipeline_pods) == 6
    selected = manifest.matching(policy["spec"]["podSelector"])
    assert {p.name for p in selected} == {p.name for p in pipeline_pods}
    rules = policy["spec"]["ingress"]
    assert len(rules) == 4

    def pod_peer(selector_of):
        return lambda peer: set(peer) == {"podSelector"} and selector_of(peer["podSelector"])

    # stages talk to each other and to their leader on ephemeral ports: every port
    own = _rule_from(policy, pod_peer(lambda s: len(manifest.matching(s)) == 6))
    assert "ports" not in own
    assert {p.name for p in manifest.matching(own["from"][0]["podSelector"])} == {
        p.name for p in pipeline_pods
    }
    # the router reaches the leaders' gRPC port, and nothing else
    router = _rule_from(
        policy, pod_peer(lambda s: selects(s, manifest.pods_of("router")[0].labels))
    )
    assert [p.name for p in manifest.matching(router["from"][0]["podSelector"])] == [
        manifest.pods_of("router")[0].name
    ]
    assert router["ports"] == [{"port": "grpc"}]
    # the decode fleet's CIDRs: NIXL and UCX listen on ephemeral ports
    decode = _rule_from(policy, lambda peer: "ipBlock" in peer and "10.8.0.0/16" in str(peer))
    assert [peer["ipBlock"]["cidr"] for peer in decode["from"]] == ["10.8.0.0/16", "fd00:8::/64"]
    assert "ports" not in decode
    # Prometheus: the namespace AND pod selector in one peer, or the CIDR; the metrics port only
    metrics = _rule_from(policy, lambda peer: "namespaceSelector" in peer)
    assert metrics["from"] == [
        {
            "namespaceSelector": NETPOL["networkPolicy"]["metrics"]["namespaceSelector"],
            "podSelector": NETPOL["networkPolicy"]["metrics"]["podSelector"],
        },
        {"ipBlock": {"cidr": "192.168.7.0/24"}},
    ]
    assert metrics["ports"] == [{"port": "metrics"}]
    # every named port resolves on the leaders, to the port their flags serve on
    for leader in manifest.pods_of("leader"):
        args = parse(leader.container(), leader.name)
        assert port_number(leader.container(), "grpc") == args.port
        assert port_number(leader.container(), "metrics") == args.metrics_port
    for rule in rules:
        for port in rule.get("ports", []):
            assert any(
                p["name"] == port["port"]
                for pod in selected
                for p in pod.container().get("ports", [])
            ), port


def test_network_policy_is_off_by_default_and_follows_the_values() -> None:
    assert not render().all("NetworkPolicy")
    values = {
        "router": {"enabled": False},
        "networkPolicy": {  # no metrics peers: no metrics rule
            "enabled": True,
            "decodeCidrs": ["10.8.0.0/16"],
            "decodePorts": [{"port": 20000, "endPort": 20999}],
            "extraIngress": [{"from": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]}],
        },
    }
    rules = render(values).one("NetworkPolicy")["spec"]["ingress"]
    assert len(rules) == 3  # own pods, decode, extra: no router rule, no metrics rule
    assert rules[1]["ports"] == [{"port": 20000, "endPort": 20999}]
    assert rules[2] == {"from": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]}


def _env_names(pod) -> list[str]:
    return [e["name"] for e in pod.container().get("env", [])]


def test_ucx_environment_reaches_every_pipeline_container_only_when_set() -> None:
    for pod in render().pods():
        assert not [n for n in _env_names(pod) if n.startswith(("UCX_", "NIXL_"))], pod.name
    assert parse(render().pods_of("leader")[0].container()).kv_progress.value == "event"
    values = {
        "pipelines": {
            "stages": 3,
            "ucx": {
                "transports": "rc,cuda_copy",
                "devices": "mlx5_0:1,mlx5_1:1",
                "extraEnv": {"UCX_IB_GID_INDEX": "3", "NIXL_LOG_LEVEL": "WARN"},
            },
        }
    }
    for manifest in (render(values), render(merge(values, STS)), render(merge(values, LWS))):
        for pod in manifest.pods_of("leader") + manifest.pods_of("stage"):
            env = container_env(pod.container(), pod.name)
            assert env["UCX_TLS"] == "rc,cuda_copy"
            assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
            assert (env["UCX_IB_GID_INDEX"], env["NIXL_LOG_LEVEL"]) == ("3", "WARN")
        (router,) = manifest.pods_of("router")
        assert not [n for n in _env_names(router) if n.startswith("UCX_")]
    only_tls = render(merge(STS, {"pipelines": {"ucx": {"transports": "tcp"}}}))
    names = _env_names(only_tls.pods_of("stage")[0])
    assert "UCX_TLS" in names and "UCX_NET_DEVICES" not in names


@pytest.mark.parametrize("values", [STS, LWS], ids=["statefulset", "lws"])
def test_gpus_give_every_stage_pod_one_gpu_cuda_and_shared_memory(values) -> None:
    gpus = {
        "pipelines": {
            "replicas": 2,
            "stages": 3,
            "gpus": {"enabled": True},
            "resources": {"limits": {"cpu": "8"}, "requests": {"memory": "16Gi"}},
        }
    }
    manifest = render(merge(values, gpus))
    pipeline_pods = manifest.pods_of("leader") + manifest.pods_of("stage")
    assert len(pipeline_pods) == 6
    for pod in pipeline_pods:
        resources = pod.container()["resources"]
        assert resources == {
            "limits": {"cpu": "8", "nvidia.com/gpu": 1},
            "requests": {"memory": "16Gi"},
        }
        shm = pod_volume(pod, "shm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "shm", "mountPath": "/dev/shm"} in pod.container()["volumeMounts"]
    for leader in manifest.pods_of("leader"):
        assert parse(leader.container()).device == "cuda"
    (router,) = manifest.pods_of("router")
    assert "resources" not in router.container()
    cpu = render(values)
    assert parse(cpu.pods_of("leader")[0].container()).device == "cpu"
    assert all("resources" not in p.container() for p in cpu.pods())
    amd = render(
        merge(values, {"pipelines": {"gpus": {"enabled": True, "resourceName": "amd.com/gpu"}}})
    )
    assert all(
        p.container()["resources"] == {"limits": {"amd.com/gpu": 1}}
        for p in amd.pods_of("leader") + amd.pods_of("stage")
    )
    explicit = {
        "pipelines": {"gpus": {"enabled": True}, "resources": {"limits": {"nvidia.com/gpu": 0}}}
    }
    assert render(merge(STS, explicit)).pods_of("stage")[0].container()["resources"] == {
        "limits": {"nvidia.com/gpu": 0}  # what the values say wins over the switch's 1
    }
