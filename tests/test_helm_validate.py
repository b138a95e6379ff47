"""The rendered chart against the Kubernetes API schemas of every version 1.25-1.37, offline and
strict (kubernetes-validate: no unknown field anywhere). It has no schema for CRDs, so the
LeaderWorkerSet and ServiceMonitor get a small schema of the fields the chart uses, with their
pod templates checked as the same version's strict PodTemplateSpec."""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files

import jsonschema
import kubernetes_validate
import pytest
import referencing

from tests.helm_harness import LWS_API, render, render_result

VERSIONS = [f"1.{minor}.0" for minor in range(25, 38)]
VARIANTS = {
    "default-bundled": ({}, ()),  # a pod per pipeline
    "statefulset-pvc-tls-monitor": (
        {
            "model": {"source": "pvc", "claimName": "weights"},
            "pipelines": {
                "kind": "StatefulSet",
                "replicas": 3,
                "stages": 4,
                "kvShipping": {"enabled": False},
                "resources": {"limits": {"cpu": "4", "memory": "8Gi"}},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "extraEnv": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "labels": {"team": "llm"},
                "annotations": {"owner": "platform"},
                "extraVolumes": [{"name": "hf", "secret": {"secretName": "hf-token"}}],
                "extraVolumeMounts": [{"name": "hf", "mountPath": "/etc/hf", "readOnly": True}],
                "extraInitContainers": [{"name": "warm", "image": "busybox", "args": ["true"]}],
                "sidecars": [{"name": "exporter", "image": "dcgm-exporter:4"}],
                "envFrom": [{"configMapRef": {"name": "nccl"}}],
                "runtimeClassName": "nvidia",
                "priorityClassName": "inference",
                "topologySpreadConstraints": [
                    {
                        "maxSkew": 1,
                        "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "ScheduleAnyway",
                    }
                ],
                "ucx": {
                    "transports": "tcp",
                    "devices": "eth0",
                    "extraEnv": {"UCX_TCP_CM_REUSEADDR": "y"},
                },
            },
            "networkPolicy": {
                "enabled": True,
                "decodeCidrs": ["10.8.0.0/16", "fd00:8::/64"],
                "decodePorts": [{"port": 20000, "endPort": 20999}],
                "metrics": {
                    "namespaceSelector": {"matchLabels": {"team": "monitoring"}},
                    "podSelector": {
                        "matchExpressions": [
                            {"key": "app", "operator": "In", "values": ["prometheus"]}
                        ]
                    },
                    "cidrs": ["192.168.7.0/24"],
                },
                "extraIngress": [{"from": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]}],
            },
            "router": {
                "replicas": 2,
                "podDisruptionBudget": {"enabled": True},
                "service": {"type": "LoadBalancer"},
            },
            "tls": {
                "router": {"secretName": "r", "clientAuth": True},
                "pipelines": {"secretName": "p", "clientAuth": True},
            },
            "metrics": {"serviceMonitor": {"enabled": True}},
            "imagePullSecrets": [{"name": "regcred"}],
            "commonLabels": {"cost-center": "llm"},
            "commonAnnotations": {"contact": "platform"},
            "helmTest": {
                "resources": {"limits": {"cpu": "1"}},
                "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                "nodeSelector": {"pool": "cpu"},
            },
            "gateway": {
                "enabled": True,
                "replicas": 2,
                "podDisruptionBudget": {"enabled": True},
                "service": {"type": "LoadBalancer", "port": 80},
                "decode": {"serviceName": "vllm", "namespace": "decode", "kvEventsPort": 5557},
            },
        },
        (),
    ),  # fmt: skip
    "pod-per-pipeline-gpus": (
        {
            "pipelines": {
                "layout": "podPerPipeline",
                "replicas": 2,
                "stages": 4,
                "gpus": {"enabled": True},
                "rollingUpdate": {"maxUnavailable": "50%", "maxSurge": 0},
            },
            "networkPolicy": {"enabled": True},
            "model": {
                "source": "huggingface",
                "huggingface": {"id": "Qwen/Qwen3-8B", "tokenSecret": {"name": "hf"}},
            },
            "autoscaling": {
                "enabled": True,
                "pipelines": {"keda": {"serverAddress": "http://prometheus.monitoring:9090"}},
            },
        },
        (LWS_API,),
    ),
    "pod-per-pipeline-port-slots": (
        {
            "model": {"source": "pvc", "claimName": "weights", "subPath": "qwen3"},
            "pipelines": {
                "replicas": 4,
                "stages": 2,
                "gpus": {"enabled": True},
                "kueueQueueName": "gpu-queue",
                "rdma": {"enabled": True, "hostNetwork": True, "portSlots": 4},
            },
            "networkPolicy": {"enabled": True},
        },
        (),
    ),
    "lws-hostpath-gpus": (
        {
            "model": {"source": "hostPath", "hostPath": "/srv/models/qwen3"},
            "pipelines": {
                "layout": "podPerStage",  # 4 GPUs fit a node: auto would take one pod
                "gpus": {"enabled": True},
                "stages": 4,
                "resources": {"limits": {"memory": "64Gi"}},
                "ucx": {"transports": "rc,cuda_copy", "devices": "mlx5_0:1"},
                "podDisruptionBudget": {"enabled": True},
                "kueueQueueName": "gpu-queue",
                "rdma": {
                    "enabled": True,
                    "resources": {"rdma/rdma_shared_device_a": 1},
                    "devicePaths": ["/dev/infiniband"],
                    "hostNetwork": True,
                    "nccl": {"ibHca": "mlx5", "ibGidIndex": 3},
                },
                "hostIPC": True,
                "podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False},
                "leaderWorkerSet": {"exclusiveTopology": "cloud.provider.com/topology-block"},
            },
            "autoscaling": {"enabled": True, "pipelines": {"provider": "hpa"}},
            "networkPolicy": {"enabled": True, "decodeCidrs": ["10.8.0.0/16"]},
            "gateway": {"enabled": True, "decode": {"urls": ["10.8.0.5:8000"]}},
        },
        (LWS_API, "monitoring.coreos.com/v1/ServiceMonitor"),
    ),
}


def _ref(name: str) -> dict:
    return {"$ref": f"https://kubernetes.io/api/_definitions.json#/$defs/{name}"}


def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties,
            "required": list(required)}  # fmt: skip


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return _closed(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind},
         "metadata": _ref("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"), "spec": spec},
        ("apiVersion", "kind", "metadata", "spec"),
    )  # fmt: skip


POD_TEMPLATE = _ref("io.k8s.api.core.v1.PodTemplateSpec")
COUNT = {"type": "integer", "minimum": 0}
CRD_SCHEMAS = {  # the fields of sigs.k8s.io/lws api/leaderworkerset/v1 the chart sets
    "LeaderWorkerSet": _resource("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", _closed({
        "replicas": COUNT,
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "rolloutStrategy": _closed({
            "type": {"enum": ["RollingUpdate"]},
            "rollingUpdateConfiguration": _closed({
                "maxUnavailable": {"type": ["integer", "string"]},
                "maxSurge": {"type": ["integer", "string"]}}),
        }, ("type",)),
        "leaderWorkerTemplate": _closed({
            "size": {"type": "integer", "minimum": 1},
            "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                       "None", "Default"]},
            "leaderTemplate": POD_TEMPLATE,
            "workerTemplate": POD_TEMPLATE,
        }, ("workerTemplate",)),
    }, ("leaderWorkerTemplate",))),
    "ScaledObject": _resource("keda.sh/v1alpha1", "ScaledObject", _closed({
        "scaleTargetRef": _closed({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string"}}, ("name",)),
        "minReplicaCount": COUNT, "maxReplicaCount": COUNT, "pollingInterval": COUNT,
        "cooldownPeriod": COUNT,
        "triggers": {"type": "array", "minItems": 1, "items": _closed({
            "type": {"const": "prometheus"}, "metricType": {"enum": ["AverageValue", "Value"]},
            "metadata": _closed({"serverAddress": {"type": "string"}, "query": {"type": "string"},
                                 "threshold": {"type": "string"}},
                                ("serverAddress", "query", "threshold"))}, ("type", "metadata"))},
    }, ("scaleTargetRef", "triggers"))),
    "ServiceMonitor": _resource("monitoring.coreos.com/v1", "ServiceMonitor", _closed({
        "selector": _ref("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"),
        "endpoints": {"type": "array", "minItems": 1, "items": _closed({
            "port": {"type": "string"}, "path": {"type": "string"},
            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}}, ("port",))},
    }, ("selector", "endpoints"))),
}  # fmt: skip


@cache
def _definitions(version: str) -> referencing.Resource:
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    path = files("kubernetes_validate").joinpath(folder, "_definitions.json")
    return referencing.Resource.from_contents(json.loads(path.read_text()))


def _validate_crd(obj: dict, version: str) -> None:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **CRD_SCHEMAS[obj["kind"]]}
    registry = _definitions(version) @ referencing.Registry()
    jsonschema.Draft202012Validator(schema, registry=registry).validate(obj)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_are_valid_for_the_kubernetes_version(variant: str, version: str) -> None:
    values, apis = VARIANTS[variant]
    manifest = render(values, kube_version=version, api_versions=apis)
    kinds = set()
    for obj in manifest.objects:
        kinds.add(obj["kind"])
        if obj["kind"] in CRD_SCHEMAS:
            _validate_crd(obj, version)
        else:
            kubernetes_validate.validate(obj, version, strict=True)
    assert {"Deployment", "Service", "Role", "RoleBinding", "ServiceAccount"} <= kinds
    assert ("LeaderWorkerSet" in kinds) == variant.startswith("lws")
    assert ("NetworkPolicy" in kinds) == (variant != "default-bundled")


def test_the_crd_schemas_catch_what_they_check() -> None:
    """The small CRD schemas are not a pass-through: a misspelt field or a bad pod fails."""
    values, apis = VARIANTS["lws-hostpath-gpus"]
    lws = render(values, api_versions=apis).one("LeaderWorkerSet")
    broken = json.loads(json.dumps(lws))
    broken["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError, match="sise"):
        _validate_crd(broken, "1.33.0")
    broken = json.loads(json.dumps(lws))
    worker = broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    worker["volumeMount"] = worker.pop("volumeMounts")
    with pytest.raises(jsonschema.ValidationError, match="volumeMount"):
        _validate_crd(broken, "1.33.0")


def test_kubernetes_older_than_1_25_is_refused() -> None:
    code, _, err = render_result(kube_version="1.24.0")
    assert code != 0 and "kubeVersion" in err, err
