"""The chart under Helm 3 as well as Helm 4 (scripts/get_helm.py extracts both from PyPI wheels):
`helm lint --strict` passes, and `helm template` renders the same objects, for value sets that
reach every template and helper (the `lookup` paths: test_helm_upgrade.py, with both)."""

from __future__ import annotations

import pytest
import yaml

from tests.helm_harness import CHART, LWS, LWS_API, PVC, STS, TLS, helm, merge, render_result

VARIANTS = {
    "default": ({}, ()),
    "lws-rdma-hatches": (
        merge(
            LWS,
            TLS,
            {
                "pipelines": {
                    "gpus": {"enabled": True},
                    "rdma": {"enabled": True, "resources": {"rdma/hca": 1}, "hostNetwork": True},
                    "leaderWorkerSet": {"exclusiveTopology": "topology/block"},
                    "kueueQueueName": "q",
                    "sidecars": [{"name": "s", "image": "busybox"}],
                    "podDisruptionBudget": {"enabled": True},
                },
                "autoscaling": {"enabled": True, "pipelines": {"provider": "hpa"}},
                "networkPolicy": {"enabled": True},
                "metrics": {"serviceMonitor": {"enabled": True}},
                "commonLabels": {"team": "llm"},
            },
        ),
        (LWS_API,),
    ),
    "pod-per-pipeline-hf-keda-gateway": (
        {
            "pipelines": {"layout": "podPerPipeline", "stages": 4},
            "model": {"source": "huggingface", "huggingface": {"id": "Qwen/Qwen3-8B"}},
            "autoscaling": {"enabled": True, "pipelines": {"keda": {"serverAddress": "http://p"}}},
            "gateway": {"enabled": True, "decode": {"serviceName": "vllm"}},
        },
        (),
    ),
    "sts-pvc-kueue": (merge(STS, PVC, {"pipelines": {"kueueQueueName": "q", "replicas": 2}}), ()),
    "port-slots": (
        {
            "pipelines": {
                "replicas": 3,
                "rdma": {"enabled": True, "hostNetwork": True, "portSlots": 2},
            }
        },
        (),
    ),
    "auto-layout-too-large-for-a-pod": (
        {"pipelines": {"gpus": {"enabled": True}, "stages": 12}},
        (LWS_API,),
    ),
}


def _objects(out: str) -> dict[tuple[str, str], dict]:
    docs = [d for d in yaml.safe_load_all(out) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_helm_binaries_are_3_and_4() -> None:
    for major in (3, 4):
        done = helm("version", "--short", major=major)
        assert done.returncode == 0 and done.stdout.startswith(f"v{major}."), done.stdout


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_3_renders_what_helm_4_renders(variant: str) -> None:
    values, apis = VARIANTS[variant]
    code3, out3, err3 = render_result(values, api_versions=apis, major=3)
    code4, out4, err4 = render_result(values, api_versions=apis, major=4)
    assert code3 == 0 and code4 == 0, err3 + err4
    assert _objects(out3) == _objects(out4)
    assert len(_objects(out3)) >= 8


@pytest.mark.parametrize("values", [{}, VARIANTS["lws-rdma-hatches"][0]], ids=["default", "lws"])
def test_helm_3_lints_the_chart_strict(values, tmp_path) -> None:
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    done = helm("lint", "--strict", str(CHART), "-f", str(tmp_path / "values.yaml"), major=3)
    assert done.returncode == 0, done.stdout + done.stderr


def test_helm_3_refuses_what_the_schema_refuses() -> None:
    code, _, err = render_result({"pipelines": {"layout": "onePod"}}, major=3)
    assert code != 0 and "layout" in err
