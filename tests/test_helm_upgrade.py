"""Upgrades: two revisions of the chart rendered side by side, and `helm template --dry-run=server
--is-upgrade` against kmock holding the release's objects, so the chart's `lookup` sees a cluster:
LWS rolls one pipeline group at a time; every pipeline pod carries one revision of the values
that shape it (a stage joins only a leader of its own revision: test_cli_serve.py); a
StatefulSet upgrade that would restart every pipeline is refused without the opt-in; and
`kind: auto` keeps the kind a release was installed with.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import yaml

from tests.helm_harness import (
    CHART,
    LWS,
    NAMESPACE,
    PER_STAGE,
    RELEASE,
    STS,
    Manifest,
    container_env,
    helm,
    merge,
    render,
    render_notes,
)

REVISION_ENV = "WAVEPP_PIPELINE_REVISION"
LEADERS = f"{RELEASE}-wavepp-pipeline"
RESOURCES = {  # what kmock serves: the kinds the chart renders by default, and LWS
    "apps/v1/statefulsets": "StatefulSet",
    "apps/v1/deployments": "Deployment",
    "v1/services": "Service",
    "v1/serviceaccounts": "ServiceAccount",
    "v1/pods": "Pod",
    "rbac.authorization.k8s.io/v1/roles": "Role",
    "rbac.authorization.k8s.io/v1/rolebindings": "RoleBinding",
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": "LeaderWorkerSet",
}


def revisions(manifest: Manifest) -> set[str]:
    """The revision of every pipeline pod and of the pipeline workload's annotation."""
    pods = manifest.pods_of("leader") + manifest.pods_of("stage")
    found = {container_env(p.container(), p.name)[REVISION_ENV] for p in pods}
    for kind in ("StatefulSet", "LeaderWorkerSet"):
        for obj in manifest.all(kind):
            if obj["metadata"]["name"] == LEADERS:
                found.add(obj["metadata"]["annotations"]["wavepp.io/pipeline-revision"])
    return found


@pytest.mark.parametrize("kind", [STS, LWS], ids=["statefulset", "lws"])
def test_every_pipeline_pod_carries_one_revision_that_follows_its_pod_values(kind) -> None:
    base = merge(kind, {"pipelines": {"replicas": 2, "stages": 3}})
    (old,) = revisions(render(base))
    (new,) = revisions(render(merge(base, {"image": {"tag": "0.2.0"}})))
    (scaled,) = revisions(render(merge(base, {"pipelines": {"replicas": 5}})))
    (resized,) = revisions(render(merge(base, {"pipelines": {"numBlocks": "2048"}})))
    assert new != old and resized != old  # the pods change: a new revision
    assert scaled == old  # more pipelines of the same pods: the running ones are untouched


def test_lws_rolls_one_pipeline_group_at_a_time_leader_and_stages_together() -> None:
    old, new = render(LWS), render(merge(LWS, {"image": {"tag": "0.2.0"}}))
    (lws_old,), (lws_new,) = old.all("LeaderWorkerSet"), new.all("LeaderWorkerSet")
    assert lws_new["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
    }
    template = lws_new["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    # one object holds both templates: LWS replaces a group's leader and stages together
    for role in ("leaderTemplate", "workerTemplate"):
        assert template[role] != lws_old["spec"]["leaderWorkerTemplate"][role]
    surge = {"pipelines": {"rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}}
    (lws,) = render(merge(LWS, surge)).all("LeaderWorkerSet")
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxUnavailable": 0,
        "maxSurge": 1,
    }


def _kubeconfig(path, server: str):
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "admin", "user": {"token": "local"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "admin"}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def cluster_render(
    kmock, tmp_path, values: dict, installed: list[dict], lws: bool, major: int = 4
):
    """`helm template --dry-run=server --is-upgrade` of ``values`` against kmock holding the
    ``installed`` objects (and serving LeaderWorkerSet with ``lws``): the API versions are what
    kmock serves, `lookup` finds those objects. -> (returncode, stdout, stderr)."""
    for resource, kind in RESOURCES.items():
        if lws or kind != "LeaderWorkerSet":
            kmock.resources[resource] = {"kind": kind, "namespaced": True, "verbs": ["get"]}
    core = [
        {"name": r.split("/")[1], "kind": k, "namespaced": True, "verbs": ["get"],
         "singularName": k.lower()}
        for r, k in RESOURCES.items() if r.startswith("v1/")
    ]  # fmt: skip
    # kmock names the core group's version "/v1" in its discovery; the client wants "v1"
    kmock["get", "/api/v1"] << {
        "apiVersion": "v1", "kind": "APIResourceList", "groupVersion": "v1", "resources": core
    }  # fmt: skip
    plural = {kind: resource for resource, kind in RESOURCES.items()}
    for obj in installed:
        kmock.objects[plural[obj["kind"]], NAMESPACE, obj["metadata"]["name"]] = obj
    config = _kubeconfig(tmp_path / "kubeconfig", str(kmock.url).rstrip("/"))
    (tmp_path / "values.json").write_text(json.dumps(values))
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--is-upgrade",
            "--dry-run=server", "--disable-openapi-validation", "--kubeconfig", str(config),
            "-f", str(tmp_path / "values.json")]  # fmt: skip
    if lws:  # Helm 3's template takes capabilities from flags, not from the server
        args += ["--api-versions", "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet"]
    done = await asyncio.to_thread(lambda: helm(*args, major=major))
    return done.returncode, done.stdout, done.stderr


def _installed(manifest: Manifest, kind: str) -> dict:
    """The release's pipeline object as the API server returns it (metadata as rendered)."""
    obj = next(o for o in manifest.all(kind) if o["metadata"]["name"] == LEADERS)
    return {**obj, "metadata": {**obj["metadata"], "namespace": NAMESPACE}}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "change, opt_in, refused",
    [
        ({"image": {"tag": "0.2.0"}}, False, True),
        ({"pipelines": {"stages": 3}}, False, True),
        ({"pipelines": {"replicas": 4}}, False, False),  # scaling: running pods untouched
        ({"router": {"replicas": 3}}, False, False),
        ({"image": {"tag": "0.2.0"}}, True, False),
    ],
    ids=["image", "stages", "scale", "router-only", "opted-in"],
)
@pytest.mark.parametrize("major", [4, 3], ids=["helm4", "helm3"])
async def test_a_statefulset_upgrade_that_restarts_every_pipeline_needs_the_opt_in(
    kmock, tmp_path, change, opt_in, refused, major
) -> None:
    installed = [_installed(render(STS), "StatefulSet")]
    values = merge(STS, change, {"pipelines": {"statefulSet": {"allowDisruptiveUpgrade": opt_in}}})
    code, out, err = await cluster_render(kmock, tmp_path, values, installed, False, major)
    if refused:
        assert code != 0 and "StatefulSet pipelines are for development" in err, err
        assert "allowDisruptiveUpgrade=true" in err
    else:
        assert code == 0, err
        assert _pipeline_kind(out) == "StatefulSet"


def _pipeline_kind(out: str) -> str:
    (kind,) = {
        d["kind"]
        for d in yaml.safe_load_all(out)
        if d and d["metadata"]["name"] == LEADERS and d["kind"] != "Service"
    }
    return kind


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "installed_kind, values, expected",
    [
        ("StatefulSet", {}, "StatefulSet"),
        ("LeaderWorkerSet", {}, "LeaderWorkerSet"),
        (None, PER_STAGE, "LeaderWorkerSet"),
        (None, {}, "Deployment"),
    ],
    ids=["sts-stays-sts", "lws-stays-lws", "fresh-install-takes-lws", "fresh-install-one-pod"],
)
@pytest.mark.parametrize("major", [4, 3], ids=["helm4", "helm3"])
async def test_kind_and_layout_auto_keep_what_the_release_was_installed_with(
    kmock, tmp_path, installed_kind, values, expected, major
) -> None:
    """The cluster serves LWS in every case (in the first, installed after the release):
    `auto` must not flip a running release to LWS, whose objects would collide by name, nor
    its pod-per-stage pipelines to the pod-per-pipeline layout that is now the default (a
    release installed before `layout: auto` existed upgrades with its layout); a fresh
    install of the defaults gets one pod per pipeline."""
    installed = []
    if installed_kind == "StatefulSet":
        installed = [_installed(render(STS), "StatefulSet")]
    elif installed_kind == "LeaderWorkerSet":
        installed = [_installed(render(LWS), "LeaderWorkerSet")]
    code, out, err = await cluster_render(kmock, tmp_path, values, installed, True, major)
    assert code == 0, err
    assert _pipeline_kind(out) == expected


def test_notes_warn_that_statefulset_pipelines_are_for_development() -> None:
    notes = " ".join(render_notes(STS).split())
    assert "WARNING: pipelines run as StatefulSets, a development mode" in notes, notes
    assert "pipelines.statefulSet.allowDisruptiveUpgrade=true" in notes
    assert "Install LeaderWorkerSet (>= 0.4)" in notes
    for values in (LWS, {}):  # LeaderWorkerSet, pod per pipeline: nothing to warn about
        assert "WARNING" not in render_notes(values)
