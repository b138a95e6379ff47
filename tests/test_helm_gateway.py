"""The gateway in helm/wavepp: its command line parses with `wavepp gateway`'s own parser and
points at the release's router and the decode fleet; its Service, HTTP probes, metrics and TLS
files agree with the flags; discovery gets exactly the RBAC it needs, in the decode Service's
namespace, and a gateway without discovery mounts no API token."""

from __future__ import annotations

import pytest

from tests.helm_harness import (
    NAMESPACE,
    RELEASE,
    TLS,
    merge,
    parse,
    pod_volume,
    port_number,
    render,
    render_result,
)

FLEET = {"gateway": {"enabled": True, "decode": {"urls": ["10.0.0.7:8000", "10.0.0.8:8000"]}}}
DISCOVERY = {
    "gateway": {
        "enabled": True,
        "decode": {"serviceName": "vllm-decode", "namespace": "decode", "kvEventsPort": 5557},
    }
}


def test_off_by_default_and_a_gateway_without_a_fleet_is_refused() -> None:
    assert render().pods_of("gateway") == []
    code, _, err = render_result({"gateway": {"enabled": True}})
    assert code != 0 and "gateway.decode.urls or gateway.decode.serviceName" in err


def test_gateway_flags_point_at_the_router_and_the_static_fleet() -> None:
    values = merge(
        FLEET,
        {
            "gateway": {
                "port": 8080,
                "prefill": "remote",
                "localMaxTokens": 64,
                "maxTierQueueSeconds": 0.5,
                "decodePrefillRate": 800,
                "servedModelName": "smol",
            },
            "router": {"port": 50060},
        },
    )
    manifest = render(values)
    (gateway,) = manifest.pods_of("gateway")
    args = parse(gateway.container())
    assert args.command == "gateway" and args.decode == ["10.0.0.7:8000", "10.0.0.8:8000"]
    assert (args.prefill, args.local_max_tokens, args.max_tier_queue) == ("remote", 64, 0.5)
    assert args.decode_prefill_rate == 800
    assert args.served_model_name == "smol" and args.k8s_service is None
    router_host, router_port = args.router.rsplit(":", 1)
    router_service = manifest.one("Service", router_host)
    (grpc,) = [p for p in router_service["spec"]["ports"] if p["name"] == "grpc"]
    assert int(router_port) == grpc["port"] == 50060
    assert args.port == port_number(gateway.container(), "http") == 8080
    service = manifest.one("Service", f"{RELEASE}-wavepp-gateway")
    assert [p.name for p in manifest.selected_by(service)] == [gateway.name]
    (http,) = service["spec"]["ports"]
    assert http["targetPort"] == "http" and http["port"] == 8000
    assert gateway.template["metadata"]["annotations"]["prometheus.io/port"] == "8080"
    # no discovery: no token, no ServiceAccount, no Role for the gateway
    assert gateway.spec["automountServiceAccountToken"] is False
    assert all("gateway" not in o["metadata"]["name"] for o in manifest.all("Role"))


@pytest.mark.parametrize(
    ("values", "router"),
    [
        ({"gateway": {"prefill": "local"}}, None),
        ({"router": {"enabled": False}}, None),
        ({}, f"{RELEASE}-wavepp-router:50050"),
    ],
    ids=["local", "no-router", "auto"],
)
def test_the_tier_is_left_out_when_every_prompt_is_local(values, router) -> None:
    (gateway,) = render(merge(FLEET, values)).pods_of("gateway")
    assert parse(gateway.container()).router == router


def test_decode_discovery_gets_endpointslice_rbac_in_the_decode_namespace() -> None:
    manifest = render(DISCOVERY)
    (gateway,) = manifest.pods_of("gateway")
    args = parse(gateway.container())
    assert (args.k8s_service, args.namespace, args.k8s_port_name) == (
        "vllm-decode",
        "decode",
        "http",
    )
    assert args.decode is None and args.decode_kv_events_port == 5557
    account = gateway.spec["serviceAccountName"]
    assert manifest.one("ServiceAccount", account)["metadata"].get("namespace") is None
    binding = manifest.one("RoleBinding", f"{RELEASE}-wavepp-gateway")
    assert binding["metadata"]["namespace"] == "decode"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    role = manifest.one("Role", binding["roleRef"]["name"])
    assert role["metadata"]["namespace"] == "decode"
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    no_rbac = render(merge(DISCOVERY, {"rbac": {"create": False}}))
    assert all("gateway" not in o["metadata"]["name"] for o in no_rbac.all("Role"))


def test_probes_ask_the_http_api_and_readiness_asks_for_a_ready_decode_instance() -> None:
    (gateway,) = render(FLEET).pods_of("gateway")
    container = gateway.container()
    paths = {
        probe: container[probe]["httpGet"]["path"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert paths == {
        "startupProbe": "/v1/models",
        "livenessProbe": "/v1/models",
        "readinessProbe": "/health",
    }
    assert {container[p]["httpGet"]["port"] for p in paths} == {"http"}


def test_with_router_tls_the_gateway_trusts_the_routers_ca_and_presents_its_cert() -> None:
    (gateway,) = render(merge(FLEET, TLS)).pods_of("gateway")
    args = parse(gateway.container())
    mounts = {m["mountPath"]: m for m in gateway.container()["volumeMounts"]}
    for flag in (args.router_ca, args.router_cert, args.router_key):
        directory = str(flag.parent)
        assert mounts[directory]["readOnly"] is True
        volume = pod_volume(gateway, mounts[directory]["name"])
        assert volume["secret"]["secretName"] == TLS["tls"]["router"]["secretName"]
    assert args.router_ca.name == "ca.crt"
    plain = parse(render(FLEET).pods_of("gateway")[0].container())
    assert plain.router_ca is None


def test_a_service_monitor_and_a_pdb_for_the_gateway_when_enabled() -> None:
    values = merge(
        FLEET,
        {
            "metrics": {"serviceMonitor": {"enabled": True}},
            "gateway": {"podDisruptionBudget": {"enabled": True}, "replicas": 2},
        },
    )
    manifest = render(values)
    (monitor,) = [
        m for m in manifest.all("ServiceMonitor") if m["metadata"]["name"].endswith("gateway")
    ]
    service = manifest.one("Service", f"{RELEASE}-wavepp-gateway")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0] == {
        "port": "http",
        "path": "/metrics",
        "interval": "15s",
    }
    (pdb,) = [p for p in manifest.all("PodDisruptionBudget") if "gateway" in p["metadata"]["name"]]
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert len(manifest.pods_of("gateway")) == 2


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gateway": {"prefill": "sometimes"}}, "prefill"),
        ({"gateway": {"decode": {"urls": ["decode-0"]}}}, "urls"),
        ({"gateway": {"decode": {"kvEventsPort": 0}}}, "kvEventsPort"),
        ({"gateway": {"maxTierQueueSeconds": 0}}, "maxTierQueueSeconds"),
        ({"gateway": {"decodePrefillRate": 0}}, "decodePrefillRate"),
        ({"gateway": {"decodes": []}}, "decodes"),
    ],
)
def test_the_values_schema_refuses_bad_gateway_values(values, message) -> None:
    code, _, err = render_result(values)
    assert code != 0 and message in err, err
