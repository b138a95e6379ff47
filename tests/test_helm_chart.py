"""Render tests of helm/wavepp: every command line parses with wavepp's own parsers, names and
ports agree across Services, pods and flags, the rendezvous env gives each pod its rank, the
model and TLS files are mounted where the flags point, and the values schema refuses bad input
(the NetworkPolicy, UCX and GPU renderings: test_helm_network.py).
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from prefill_node import tracing
from prefill_node.runtime.dist_env import DistEnv
from prefill_node.server.server import SERVICE_NAME
from tests.helm_harness import (
    CHART,
    LWS,
    LWS_API,
    NAMESPACE,
    NETPOL,
    PER_STAGE,
    PVC,
    RELEASE,
    STS,
    TLS,
    command_line,
    container_env,
    helm,
    merge,
    parse,
    pod_volume,
    port_number,
    render,
    render_result,
)


@pytest.mark.parametrize(
    "values",
    [
        {},
        merge(LWS, PVC, TLS, NETPOL, {"pipelines": {"gpus": {"enabled": True}}}),
        merge(
            STS,
            TLS,
            {
                "metrics": {"serviceMonitor": {"enabled": True}},
                "router": {"podDisruptionBudget": {"enabled": True}},
            },
        ),
    ],
    ids=["default", "lws", "sts-tls"],
)
def test_chart_lints_strict(tmp_path, values) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    done = helm("lint", "--strict", str(CHART), "-f", str(path), "--namespace", NAMESPACE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize(
    ("kind", "apis", "expected"),
    [
        ("auto", (), "StatefulSet"),
        ("auto", (LWS_API,), "LeaderWorkerSet"),
        ("StatefulSet", (LWS_API,), "StatefulSet"),
        ("LeaderWorkerSet", (), "LeaderWorkerSet"),
    ],
)
def test_pipeline_kind_follows_the_clusters_api_unless_chosen(kind, apis, expected) -> None:
    manifest = render({"pipelines": {"kind": kind, "layout": "podPerStage"}}, api_versions=apis)
    other = "LeaderWorkerSet" if expected == "StatefulSet" else "StatefulSet"
    assert manifest.all(expected) and not manifest.all(other)


def test_leader_flags_match_its_ports_service_and_values() -> None:
    values = {
        "pipelines": {
            "stages": 3,
            "numBlocks": "64,32,32",
            "maxModelLen": 1048576,  # Helm reads it as a float: it must not print 1.048576e+06
            "maxChunkTokens": 2097152,
            "minWaveTokens": 1048576,
            "waveOverheadTokens": 24,
            "threads": 4,
            "port": 7001,
            "metricsPort": 7002,
        },
        "grpc": {"logLevel": "DEBUG"},
    }
    manifest = render(values)
    (leader,) = manifest.pods_of("leader")
    args = parse(leader.container(), leader.name)
    assert args.command == "serve" and args.stages == 3 and args.num_blocks == "64,32,32"
    assert (args.max_model_len, args.max_chunk_tokens, args.threads) == (1048576, 2097152, 4)
    assert (args.min_wave_tokens, args.wave_overhead_tokens) == (1048576, 24)
    assert args.port == port_number(leader.container(), "grpc") == 7001
    assert args.metrics_port == port_number(leader.container(), "metrics") == 7002
    assert leader.template["metadata"]["annotations"]["prometheus.io/port"] == "7002"
    assert args.log_level == "DEBUG" and args.model is None  # bundled: the default model
    service = manifest.one("Service", f"{RELEASE}-wavepp-pipelines")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"grpc": 7001, "metrics": 7002}


@pytest.mark.parametrize("values", [STS, LWS], ids=["statefulset", "lws"])
def test_a_one_stage_pipeline_is_a_leader_alone(values) -> None:
    manifest = render(merge(values, {"pipelines": {"stages": 1, "replicas": 2}}))
    assert len(manifest.pods_of("leader")) == 2 and manifest.pods_of("stage") == []
    assert all(parse(p.container()).stages == 1 for p in manifest.pods_of("leader"))


def test_router_discovers_exactly_the_leaders_with_the_rbac_it_needs() -> None:
    manifest = render(merge(PER_STAGE, {"pipelines": {"replicas": 2, "stages": 3, "port": 7001}}))
    (router,) = manifest.pods_of("router")
    args = parse(router.container())
    assert (args.command, args.namespace, args.pipeline) == ("router", NAMESPACE, None)
    service = manifest.one("Service", args.k8s_service)
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses")  # readiness gates discovery
    assert {p.name for p in manifest.selected_by(service)} == {
        f"{RELEASE}-wavepp-pipeline-0",
        f"{RELEASE}-wavepp-pipeline-1",
    }
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == args.k8s_port_name]
    for leader in manifest.selected_by(service):
        assert port_number(leader.container(), port["targetPort"]) == 7001
    account = router.spec["serviceAccountName"]
    assert manifest.one("ServiceAccount", account)
    binding = manifest.one("RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    role = manifest.one("Role", binding["roleRef"]["name"])
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    router_service = manifest.one("Service", f"{RELEASE}-wavepp-router")
    assert [p.name for p in manifest.selected_by(router_service)] == [router.name]
    assert args.port == port_number(router.container(), "grpc")


def test_the_routers_flow_control_values_become_its_flags() -> None:
    flow = {"maxInflightPerPipeline": 8, "maxQueue": 64, "maxWaitSeconds": 1.5}
    (router,) = render({"router": {"flowControl": flow}}).pods_of("router")
    args = parse(router.container())
    assert (args.max_inflight_per_pipeline, args.max_queue, args.max_wait) == (8, 64, 1.5)
    (default,) = render({}).pods_of("router")
    assert parse(default.container()).max_wait == 0  # no bound unless the operator sets one


def test_the_fetch_policy_needs_kv_agents_allowed_to_read_other_pipelines() -> None:
    allow = {"enabled": True, "allow": ["10.0.0.0/8"]}
    values = {"router": {"policy": "fetch"}, "pipelines": {"kvShipping": allow}}
    (router,) = render(values).pods_of("router")
    assert parse(router.container()).policy == "fetch"
    for kv, message in (
        ({"enabled": False, "allow": ["10.0.0.0/8"]}, "kvShipping.enabled"),
        ({"enabled": True, "allow": []}, "kvShipping.allow"),
    ):
        code, _, err = render_result({"router": {"policy": "fetch"},
                                      "pipelines": {"kvShipping": kv}})  # fmt: skip
        assert code != 0 and message in err, err


def _stage_rank(pod, env: dict, tmp_path) -> int:
    """Run the stage's real shell command with a `wavepp` on PATH that prints RANK."""
    fake = tmp_path / "wavepp"
    fake.write_text('#!/bin/sh\necho "$RANK $*"\n')
    fake.chmod(0o755)
    argv = command_line(pod.container(), env)
    done = subprocess.run(
        argv,
        env={**env, "HOSTNAME": pod.name, "PATH": f"{tmp_path}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    rank, rest = done.stdout.split(" ", 1)
    assert rest.split()[0] == "stage"
    return int(rank)


def test_statefulset_pods_get_torchrun_ranks_and_find_their_leader(tmp_path) -> None:
    manifest = render(
        {"pipelines": {"kind": "StatefulSet", "replicas": 2, "stages": 4, "rendezvousPort": 29600}}
    )
    leaders_sts = manifest.one("StatefulSet", f"{RELEASE}-wavepp-pipeline")
    headless = manifest.one("Service", leaders_sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # stages join before ready
    assert {p.name for p in manifest.selected_by(headless)} == {
        p.name for p in manifest.pods_of("leader")
    }
    seen = set()
    for pod in manifest.pods_of("leader") + manifest.pods_of("stage"):
        env = container_env(pod.container(), pod.name)
        if pod.labels["app.kubernetes.io/component"] == "stage":
            env["RANK"] = str(_stage_rank(pod, env, tmp_path))
            group = int(pod.labels["wavepp.io/pipeline"])
            leader = f"{RELEASE}-wavepp-pipeline-{group}"
            assert env["MASTER_ADDR"] == f"{leader}.{headless['metadata']['name']}.{NAMESPACE}.svc"
        else:
            group = int(pod.name.rsplit("-", 1)[1])
            assert env["MASTER_ADDR"] == "127.0.0.1"  # its own pod IP
            assert port_number(pod.container(), "rendezvous") == 29600
        dist = DistEnv.from_env(env)
        assert (dist.world_size, dist.master_port) == (4, 29600)
        seen.add((group, dist.rank))
    assert seen == {(g, r) for g in range(2) for r in range(4)}
    for group in range(2):  # distinct selectors: one StatefulSet per pipeline's stages
        sts = manifest.one("StatefulSet", f"{RELEASE}-wavepp-pipeline-{group}-stages")
        assert sts["spec"]["selector"]["matchLabels"]["wavepp.io/pipeline"] == str(group)
        assert sts["spec"]["replicas"] == 3


def test_leaderworkerset_pods_get_ranks_from_the_lws_variables() -> None:
    values = merge(PER_STAGE, {"pipelines": {"replicas": 2, "stages": 3}})
    manifest = render(values, api_versions=(LWS_API,))
    lws = manifest.one("LeaderWorkerSet")
    name = lws["metadata"]["name"]
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 3
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # LeaderReady would deadlock
    assert not manifest.all("StatefulSet") and len(manifest.all("Service")) == 2
    for pod in manifest.pods_of("leader") + manifest.pods_of("stage"):
        group, _, worker = pod.name.removeprefix(f"{name}-").partition("-")
        injected = {  # what the LWS pod webhook prepends to every container's env
            "LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{NAMESPACE}",
            "LWS_GROUP_SIZE": "3",
            "LWS_WORKER_INDEX": worker or "0",
        }
        env = container_env(pod.container(), pod.name, injected)
        dist = DistEnv.from_env(env)
        assert (dist.rank, dist.world_size) == (int(worker or 0), 3)
        expected = "127.0.0.1" if dist.is_leader else injected["LWS_LEADER_ADDRESS"]
        assert dist.master_addr == expected
        argv = command_line(pod.container(), env)
        assert argv[:2] == (["wavepp", "serve"] if dist.is_leader else ["wavepp", "stage"])


@pytest.mark.parametrize("values", [{}, STS, LWS], ids=["pod-per-pipeline", "statefulset", "lws"])
def test_probes_are_native_grpc_health_on_the_serving_ports(values) -> None:
    manifest = render(values)
    for pod in manifest.pods_of("leader") + manifest.pods_of("router"):
        container = pod.container()
        grpc_port = port_number(container, "grpc")
        services = {
            kind: container[kind]["grpc"]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe")
        }
        assert services == {
            "startupProbe": {"port": grpc_port, "service": ""},
            "livenessProbe": {"port": grpc_port, "service": ""},
            "readinessProbe": {"port": grpc_port, "service": SERVICE_NAME},
        }
    for pod in manifest.pods_of("leader") + manifest.pods_of("router"):
        container = pod.container()
        assert {container[k]["timeoutSeconds"] for k in container if k.endswith("Probe")} == {5}
    for pod in manifest.pods_of("stage"):
        container = pod.container()
        assert not {"ports", "livenessProbe", "readinessProbe"} & container.keys()


@pytest.mark.parametrize("wait, load, period", [(600, 120, 10), (45, 20, 7), (1800, 0, 30)])
def test_the_leaders_startup_allowance_covers_its_load_and_its_stage_wait(wait, load, period):
    """The leader gives up on a missing stage (`--stage-wait`) before kubelet's startup
    probe kills it: the probe allows the leader's own load plus the stage wait."""
    values = {
        "pipelines": {
            "stageWaitSeconds": wait,
            "startupProbe": {"periodSeconds": period, "timeoutSeconds": 3, "loadSeconds": load},
            "livenessProbe": {"periodSeconds": 20, "timeoutSeconds": 9, "failureThreshold": 4},
        }
    }
    (leader,) = render(values).pods_of("leader")
    container = leader.container()
    assert parse(container).stage_wait == wait
    startup = container["startupProbe"]
    allowance = startup["periodSeconds"] * startup["failureThreshold"]
    assert wait + load <= allowance < wait + load + period
    assert (startup["periodSeconds"], startup["timeoutSeconds"]) == (period, 3)
    liveness = container["livenessProbe"]
    assert [liveness[k] for k in ("periodSeconds", "timeoutSeconds", "failureThreshold")] == [
        20,
        9,
        4,
    ]


def test_tls_secrets_are_mounted_where_the_flags_point_and_probes_fall_back_to_tcp() -> None:
    manifest = render(merge(PER_STAGE, TLS))
    (leader,) = manifest.pods_of("leader")
    (router,) = manifest.pods_of("router")
    leader_args, router_args = parse(leader.container()), parse(router.container())
    for pod, files in (
        (leader, [leader_args.tls_cert, leader_args.tls_key, leader_args.tls_client_ca]),
        (
            router,
            [
                router_args.tls_cert,
                router_args.tls_key,
                router_args.tls_client_ca,
                router_args.pipeline_ca,
                router_args.pipeline_cert,
                router_args.pipeline_key,
            ],
        ),
    ):
        secrets = {
            v["name"]: v["secret"]["secretName"] for v in pod.spec["volumes"] if "secret" in v
        }
        mounts = {
            m["mountPath"]: secrets[m["name"]]
            for m in pod.container()["volumeMounts"]
            if m["name"] in secrets
        }
        for file in files:
            assert file is not None and str(file.parent) in mounts, (pod.name, file)
        assert all(
            pod.container()[p].keys() >= {"tcpSocket"} for p in ("livenessProbe", "readinessProbe")
        )
    assert str(leader_args.tls_cert).startswith("/etc/wavepp/tls/pipelines/")
    assert str(router_args.tls_cert).startswith("/etc/wavepp/tls/router/")
    assert router_args.pipeline_ca.parent == leader_args.tls_client_ca.parent
    for pod in manifest.pods_of("stage"):
        assert not any("secret" in v for v in pod.spec["volumes"])
    assert not manifest.all("Pod")  # no `helm test` pod: it speaks plaintext


def test_kv_flags_build_the_stages_handoff_config() -> None:
    from prefill_node.cli.serve import _kv_handoff

    allow = ["10.0.0.0/8", "fd00::/8", "decode-agent-a"]
    manifest = render({"pipelines": {"kvShipping": {"allow": allow, "progress": "poll"}}})
    config = _kv_handoff(parse(manifest.pods_of("leader")[0].container()))
    assert config.metadata_host == "0.0.0.0"  # each stage advertises its own pod IP
    assert config.progress.value == "poll"
    assert config.allow == type(config.allow).parse(allow[:2], allow[2:])
    assert config.stream  # streamed push by default
    assert config.stream_layer_groups == 4
    at_end = render({"pipelines": {"kvShipping": {"stream": False, "streamLayerGroups": 1}}})
    at_end_config = _kv_handoff(parse(at_end.pods_of("leader")[0].container()))
    assert not at_end_config.stream and at_end_config.stream_layer_groups == 1
    off = render({"pipelines": {"kvShipping": {"enabled": False}}})
    assert _kv_handoff(parse(off.pods_of("leader")[0].container())) is None


@pytest.mark.parametrize("layout", [PER_STAGE, {}], ids=["pod-per-stage", "pod-per-pipeline"])
def test_a_pvc_model_is_mounted_read_only_at_one_path_in_every_pod(layout) -> None:
    """Pipeline pods mount the claim; the router and gateway mount, at the same path, a copy of
    the config and tokenizer files an init container made (it alone mounts the claim)."""
    gateway = {"gateway": {"enabled": True, "decode": {"urls": ["d:8000"]}}}
    manifest = render(merge(layout, PVC, gateway))
    pods = manifest.pods()
    components = {"router", "gateway", "leader", "stage"} - ({"stage"} if not layout else set())
    assert {p.labels["app.kubernetes.io/component"] for p in pods} == components
    claim = {"claimName": "weights", "readOnly": True}
    for pod in pods:
        (mount,) = [m for m in pod.container()["volumeMounts"] if m["name"] == "model"]
        if pod in manifest.pods_of("leader") + manifest.pods_of("stage"):
            assert pod_volume(pod, "model")["persistentVolumeClaim"] == claim
            assert mount == {
                "name": "model",
                "mountPath": "/models/checkpoint",
                "readOnly": True,
                "subPath": "qwen3",
            }
            assert "initContainers" not in pod.spec
            continue
        assert mount == {"name": "model", "mountPath": "/models/checkpoint", "readOnly": True}
        assert pod_volume(pod, "model") == {"name": "model", "emptyDir": {"sizeLimit": "64Mi"}}
        assert pod_volume(pod, "model-source")["persistentVolumeClaim"] == claim
        assert not [m for m in pod.container()["volumeMounts"] if m["name"] == "model-source"]
        (init,) = pod.spec["initContainers"]
        assert init["name"] == "copy-model-files"
        source, target, patterns = init["args"][1:]
        assert {
            "name": "model-source",
            "mountPath": source,
            "readOnly": True,
            "subPath": "qwen3",
        } in init["volumeMounts"]
        assert {"name": "model", "mountPath": target} in init["volumeMounts"]
        assert target == "/models/checkpoint"
        assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
            patterns.split(",")
        )
    for pod in (
        manifest.pods_of("leader") + manifest.pods_of("router") + manifest.pods_of("gateway")
    ):
        assert str(parse(pod.container()).model) == "/models/checkpoint"


def test_the_bundled_model_is_prepared_in_every_pod_under_its_cache() -> None:
    manifest = render()
    for pod in manifest.pods():
        (init,) = pod.spec["initContainers"]
        main = pod.container()
        cache = container_env(main, pod.name)["WAVEPP_CACHE_DIR"]
        assert container_env(init, pod.name)["WAVEPP_CACHE_DIR"] == cache
        for container in (init, main):
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == cache]
            assert "emptyDir" in pod_volume(pod, mount["name"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"pipelines": {"stages": 0}}, "stages"),
        ({"pipelines": {"policy": "fifo"}}, "policy"),
        ({"pipelines": {"numBlocks": "64,x"}}, "numBlocks"),
        ({"pipelines": {"numBlocks": 64}}, "numBlocks"),
        ({"pipelines": {"kind": "Deployment"}}, "kind"),
        ({"pipelines": {"port": 70000}}, "port"),
        ({"router": {"policy": "random"}}, "policy"),
        ({"pipelines": {"kvShipping": {"progress": "spin"}}}, "progress"),
        ({"pipelines": {"kvShipping": {"stream": "on"}}}, "stream"),
        ({"pipelines": {"kvShipping": {"streamLayerGroups": 0}}}, "streamLayerGroups"),
        ({"pipeline": {"stages": 2}}, "pipeline"),
        ({"model": {"source": "pvc"}}, "claimName"),
        ({"model": {"source": "hostPath", "hostPath": "models"}}, "hostPath"),
        ({"model": {"source": "s3"}}, "source"),
        ({"pipelines": {"gpus": {"enabled": "yes"}}}, "gpus"),
        ({"pipelines": {"gpus": {"count": 2}}}, "count"),
        ({"pipelines": {"ucx": {"extraEnv": {"LD_PRELOAD": "/x.so"}}}}, "LD_PRELOAD"),
        ({"pipelines": {"ucx": {"transports": "rc cuda_copy"}}}, "transports"),
        ({"networkPolicy": {"enabled": 1}}, "networkPolicy"),
        ({"networkPolicy": {"decodeCidrs": ["10.8.0.0"]}}, "decodeCidrs"),
        ({"networkPolicy": {"metrics": {"podSelector": {"matchLabel": {}}}}}, "matchLabel"),
        ({"networkPolicy": {"decodePorts": [{"port": 0}]}}, "decodePorts"),
        ({"tracing": {"otlpEndpoint": "jaeger:4318"}}, "otlpEndpoint"),
    ],
)
def test_the_values_schema_refuses_bad_values(values, message) -> None:
    code, _, err = render_result(values)
    assert code != 0 and message in err, err


def test_tracing_reaches_every_container_only_when_an_endpoint_is_set(monkeypatch) -> None:
    endpoint = "http://jaeger-collector.observability:4318"
    fleet = {"gateway": {"enabled": True, "decode": {"urls": ["10.0.0.7:8000"]}}}
    pods = []
    for layout, roles in (("podPerStage", {"router", "leader", "stage", "gateway"}),
                          ("podPerPipeline", {"router", "leader", "gateway"})):  # fmt: skip
        values = {"tracing": {"otlpEndpoint": endpoint}, "pipelines": {"layout": layout}}
        found = render(merge(fleet, values)).pods()
        assert {p.labels["app.kubernetes.io/component"] for p in found} == roles
        pods += found
    for pod in pods:
        env = container_env(pod.container(), pod.name)
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == endpoint, pod.name
        # what every wavepp process makes of it when no --otlp-endpoint is given
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env[tracing.ENDPOINT_ENV])
        assert tracing.resolve_endpoint(None) == endpoint + "/v1/traces"
    for pod in render(fleet).pods():  # the default: off
        assert tracing.ENDPOINT_ENV not in container_env(pod.container(), pod.name), pod.name


def test_long_release_names_keep_every_name_within_kubernetes_limits() -> None:
    values = {
        "fullnameOverride": "a-very-long-release-name-for-the-prefill-tier-of-team-x",
        "pipelines": {"replicas": 12, "kind": "StatefulSet"},
    }
    manifest = render(values)
    for obj in manifest.objects:
        limit = 52 if obj["kind"] == "StatefulSet" else 63  # + controller-revision-hash
        assert len(obj["metadata"]["name"]) <= limit, obj["metadata"]["name"]
    for pod in manifest.pods():
        assert len(pod.name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", pod.name)


def test_optional_objects_appear_when_enabled() -> None:
    base = render()
    assert not base.all("ServiceMonitor") and not base.all("PodDisruptionBudget")
    on = render(
        {
            "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}},
            "router": {"podDisruptionBudget": {"enabled": True}},
        }
    )
    for monitor in on.all("ServiceMonitor"):
        (service,) = [
            s
            for s in on.all("Service")
            if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
            and any(p["name"] == "metrics" for p in s["spec"]["ports"])
        ]
        assert monitor["metadata"]["labels"]["release"] == "kps"
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert service["metadata"]["name"] in (
            f"{RELEASE}-wavepp-router",
            f"{RELEASE}-wavepp-pipelines",
        )
    assert len(on.all("ServiceMonitor")) == 2
    pdb = on.one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    no_router = render({"router": {"enabled": False}})
    kinds = {o["kind"] for o in no_router.objects}
    assert kinds == {"Service", "Deployment"}, kinds  # the pipelines alone


def test_every_value_has_a_helm_docs_comment() -> None:
    """helm-docs lists a key with a `# --` comment above it; a documented map covers its keys."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, ancestors = [], []  # ancestors: (indent, documented) of the enclosing keys
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z]\w*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3)
        while ancestors and ancestors[-1][0] >= indent:
            ancestors.pop()
        above = i - 1
        while above >= 0 and lines[above].lstrip().startswith("#") and "# --" not in lines[above]:
            above -= 1
        documented = above >= 0 and "# --" in lines[above] or any(d for _, d in ancestors)
        following = next(
            (x for x in lines[i + 1 :] if x.strip() and not x.lstrip().startswith("#")), ""
        )
        section = not rest.strip() and len(following) - len(following.lstrip()) > indent
        if section and not following.lstrip().startswith("-"):
            ancestors.append((indent, documented))
        elif not documented:
            undocumented.append(key)
    assert undocumented == []


def test_the_image_runs_as_the_user_with_the_cache_and_sources_the_chart_expects() -> None:
    """Containerfile vs the chart's defaults (the build itself is too slow for the test run)."""
    import tomllib

    repo = CHART.parent.parent
    containerfile = (repo / "Containerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pod = values["podSecurityContext"]
    assert re.search(rf"^USER {pod['runAsUser']}:{pod['runAsGroup']}$", containerfile, re.M)
    assert f"WAVEPP_CACHE_DIR={values['cache']['path']} " in containerfile
    assert 'ENTRYPOINT ["wavepp"]' in containerfile
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", containerfile, re.M))
    includes = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {
        path.parent.name
        for pattern in includes["packages"]["find"]["include"]
        for path in repo.glob(f"{pattern.rstrip('*')}/__init__.py")
    }
    assert packages and packages == copied
    let_through = (repo / ".containerignore").read_text().splitlines()
    assert {f"!{name}" for name in packages | {"pyproject.toml", "build/wheels"}} <= set(
        let_through
    )
