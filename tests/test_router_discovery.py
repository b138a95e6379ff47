"""Pipeline discovery: static addresses, and EndpointSlices watched with the real kubernetes client.

The Kubernetes tests run the real `kubernetes` client against kmock's API emulator (an aiohttp
server on this test's event loop), so every blocking client call goes through a thread.
What kmock does not do, and how these tests cover it: it ignores label selectors (slices of
another Service come back and must be filtered by the discovery), sets no resourceVersion and
replays ADDED for every existing slice at each watch start (events must be idempotent), ignores
timeoutSeconds and never ends a watch, sends no 410 (reactions below inject a watch that ends,
fails, is gone or drops its connection, while the API's truth changes behind its back).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import pytest_asyncio
from kubernetes import client

from prefill_node.errors import InvalidRequestError, InvariantError
from prefill_router.discovery import (
    SERVICE_NAME_LABEL,
    EndpointSliceDiscovery,
    InvalidPipelineAddressError,
    PipelineEndpoint,
    StaticDiscovery,
)

NAMESPACE = "wavepp"
SERVICE = "prefill"
RESOURCE = "discovery.k8s.io/v1/endpointslices"


def endpoint(ip: str, pod: str | None, ready: bool | None = True) -> dict:
    found: dict = {"addresses": [ip], "conditions": {} if ready is None else {"ready": ready}}
    if pod is not None:
        found["targetRef"] = {"kind": "Pod", "name": pod, "namespace": NAMESPACE}
    return found


def endpoint_slice(name, service, endpoints, ports=(("grpc", 50051),), address_type="IPv4"):
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {SERVICE_NAME_LABEL: service}},
        "addressType": address_type,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports],
        "endpoints": endpoints,
    }


def status(code: int, reason: str) -> dict:
    return {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "code": code,
            "reason": reason,
            "message": reason,
        },
    }


def pipelines(*pairs: tuple[str, str]) -> frozenset[PipelineEndpoint]:
    return frozenset(PipelineEndpoint(id_, address) for id_, address in pairs)


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def watch_subscribed(kmock) -> bool:
    # kmock has no public signal that a watch reached its event bus; events put before that
    # are lost to the watch (its list snapshot was taken earlier), so wait on the bus itself.
    return any(bus.consumer_count for bus in kmock._buses.values())


class Cluster:
    """The test's side of the API: the real client, called off the event loop."""

    def __init__(self, api: client.DiscoveryV1Api) -> None:
        self.api = api

    async def create(self, body: dict) -> None:
        await asyncio.to_thread(self.api.create_namespaced_endpoint_slice, NAMESPACE, body)

    async def patch(self, name: str, body: dict) -> None:
        await asyncio.to_thread(self.api.patch_namespaced_endpoint_slice, name, NAMESPACE, body)

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self.api.delete_namespaced_endpoint_slice, name, NAMESPACE)


def api_client(kmock) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=str(kmock.url).rstrip("/")))


@pytest_asyncio.fixture
async def cluster(kmock) -> Cluster:
    kmock.resources[RESOURCE] = {}
    return Cluster(client.DiscoveryV1Api(api_client(kmock)))


@pytest_asyncio.fixture
async def discover(kmock):
    """Start an EndpointSliceDiscovery on kmock; returns (discovery, on_change calls)."""
    started: list[EndpointSliceDiscovery] = []
    gate = asyncio.Event()  # held by injected watch reactions; released at teardown

    def start(port_name: str | None = "grpc", **timings) -> tuple[EndpointSliceDiscovery, list]:
        timings = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, **timings}
        discovery = EndpointSliceDiscovery(
            SERVICE, NAMESPACE, port_name, api_client(kmock), **timings
        )
        calls: list[frozenset[PipelineEndpoint]] = []
        discovery.start(calls.append)
        started.append(discovery)
        return discovery, calls

    start.gate = gate
    yield start
    gate.set()
    for discovery in started:
        await asyncio.to_thread(discovery.stop)


def test_static_discovery_reports_its_set_once_on_start() -> None:
    discovery = StaticDiscovery(["10.0.0.1:50051", "[fd00::1]:50052", "pipe-0.prefill:7000"])
    calls: list[frozenset[PipelineEndpoint]] = []
    discovery.start(calls.append)
    expected = pipelines(
        ("10.0.0.1:50051", "10.0.0.1:50051"),
        ("[fd00::1]:50052", "[fd00::1]:50052"),
        ("pipe-0.prefill:7000", "pipe-0.prefill:7000"),
    )
    assert calls == [expected]
    assert discovery.current() == expected
    discovery.stop()
    with pytest.raises(InvariantError):
        discovery.start(calls.append)


@pytest.mark.parametrize(
    ("addresses", "fix"),
    [
        (["10.0.0.1"], "lacks a host or a port"),
        ([":50051"], "lacks a host or a port"),
        (["10.0.0.1:0"], "needs a port number in 1-65535"),
        (["10.0.0.1:65536"], "needs a port number in 1-65535"),
        (["host:grpc"], "needs a port number in 1-65535"),
        (["fd00::1:50051"], "needs its IPv6 host in brackets"),
        (["[fd00::1:50051"], r"needs an IPv6 host as \[addr\]:port"),
        (["[]:50051"], r"needs an IPv6 host as \[addr\]:port"),
        (["http://10.0.0.1:50051"], "has a scheme"),
        ([" 10.0.0.1:50051"], "holds whitespace"),
        ([""], "is empty"),
        ([], "no pipeline addresses"),
        ("10.0.0.1:50051", "give a list"),
        (["10.0.0.1:50051", "10.0.0.1:50051"], "listed twice"),
    ],
)
def test_static_discovery_says_what_to_fix(addresses, fix: str) -> None:
    with pytest.raises(InvalidPipelineAddressError, match=fix) as raised:
        StaticDiscovery(addresses)
    assert isinstance(raised.value, InvalidRequestError)


@pytest.mark.asyncio
async def test_first_sync_reports_an_empty_service(cluster, discover) -> None:
    discovery, calls = discover()
    await eventually(lambda: calls)
    assert calls == [frozenset()]
    assert discovery.current() == frozenset()


@pytest.mark.asyncio
async def test_initial_list_keeps_ready_endpoints_of_the_service_only(
    kmock,
    cluster,
    discover,
) -> None:
    await cluster.create(
        endpoint_slice(
            "prefill-a",
            SERVICE,
            [
                endpoint("10.0.0.1", "pod-0"),
                endpoint("10.0.0.2", "pod-1", ready=None),  # unset ready counts as ready
                endpoint("10.0.0.3", "pod-2", ready=False),
            ],
            ports=(("metrics", 9090), ("grpc", 50051)),
        )
    )
    await cluster.create(endpoint_slice("prefill-b", SERVICE, [{"addresses": ["10.0.0.4"]}]))
    await cluster.create(
        endpoint_slice("prefill-v6", SERVICE, [endpoint("fd00::5", "pod-5")], address_type="IPv6")
    )
    await cluster.create(
        endpoint_slice(
            "prefill-metrics", SERVICE, [endpoint("10.0.0.6", "pod-6")], ports=(("metrics", 9090),)
        )
    )
    await cluster.create(endpoint_slice("other-a", "other", [endpoint("10.0.0.7", "pod-7")]))
    discovery, calls = discover()
    initial = pipelines(
        ("pod-0", "10.0.0.1:50051"),
        ("pod-1", "10.0.0.2:50051"),
        ("10.0.0.4:50051", "10.0.0.4:50051"),
        ("pod-5", "[fd00::5]:50051"),
    )
    await eventually(lambda: calls)
    assert calls == [initial]
    assert discovery.current() == initial
    # kmock's watch replays ADDED for all five slices; none of that may report a change
    await eventually(lambda: watch_subscribed(kmock))
    await cluster.create(endpoint_slice("prefill-c", SERVICE, [endpoint("10.0.0.8", "pod-8")]))
    await eventually(lambda: len(calls) == 2)
    assert calls == [initial, initial | pipelines(("pod-8", "10.0.0.8:50051"))]


@pytest.mark.asyncio
async def test_port_name_none_takes_a_slices_only_port(cluster, discover) -> None:
    await cluster.create(
        endpoint_slice("prefill-a", SERVICE, [endpoint("10.0.0.1", "pod-0")], ports=(("", 7000),))
    )
    await cluster.create(
        endpoint_slice(
            "prefill-b",
            SERVICE,
            [endpoint("10.0.0.2", "pod-1")],
            ports=(("grpc", 50051), ("metrics", 9090)),
        )
    )
    discovery, calls = discover(port_name=None)
    await eventually(lambda: calls)
    assert calls == [pipelines(("pod-0", "10.0.0.1:7000"))]


@pytest.mark.asyncio
async def test_watch_events_remove_and_add_pipelines_in_order(kmock, cluster, discover) -> None:
    await cluster.create(
        endpoint_slice(
            "prefill-a", SERVICE, [endpoint("10.0.0.1", "pod-0"), endpoint("10.0.0.2", "pod-1")]
        )
    )
    discovery, calls = discover()
    await eventually(lambda: calls and watch_subscribed(kmock))
    await cluster.patch(
        "prefill-a",
        {"endpoints": [endpoint("10.0.0.1", "pod-0"), endpoint("10.0.0.2", "pod-1", ready=False)]},
    )
    await cluster.create(endpoint_slice("other-a", "other", [endpoint("10.0.0.9", "pod-9")]))
    await cluster.create(endpoint_slice("prefill-b", SERVICE, [endpoint("10.0.0.3", "pod-2")]))
    await cluster.delete("prefill-a")
    await cluster.patch("prefill-b", {"metadata": {"labels": {SERVICE_NAME_LABEL: "other"}}})
    await eventually(lambda: len(calls) == 5)
    assert calls == [
        pipelines(("pod-0", "10.0.0.1:50051"), ("pod-1", "10.0.0.2:50051")),
        pipelines(("pod-0", "10.0.0.1:50051")),
        pipelines(("pod-0", "10.0.0.1:50051"), ("pod-2", "10.0.0.3:50051")),
        pipelines(("pod-2", "10.0.0.3:50051")),
        frozenset(),
    ]
    assert discovery.current() == frozenset()


async def held(gate: asyncio.Event) -> None:
    await gate.wait()  # returns None: kmock would stream Event.wait()'s True as a JSON line


# ending -> (the first watch's reaction, what the discovery logs about it)
WATCH_ENDINGS = {
    "ends": (lambda gate: (b"", held(gate)), None),  # a watch timeout: the stream just ends
    "gone_410": (
        lambda gate: (b"", held(gate), status(410, "Expired")),
        "expired (ApiException: (410) Reason: Expired: Expired)",
    ),
    "fails_500": (
        lambda gate: (b"", held(gate), status(500, "InternalError")),
        "failed (ApiException: (500) Reason: InternalError: InternalError)",
    ),
    "drops_connection": (
        lambda gate: (b"", held(gate), lambda request: request._raw_request.transport.close()),
        "failed (ProtocolError: Response ended prematurely)",
    ),
    "goes_silent": (lambda gate: (b"", held(gate)), "expired (ReadTimeoutError: "),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("ending", sorted(WATCH_ENDINGS))
async def test_a_watch_that_ends_relists_to_the_apis_truth(
    kmock,
    cluster,
    discover,
    caplog,
    ending: str,
) -> None:
    reaction, logged = WATCH_ENDINGS[ending]
    caplog.set_level(logging.INFO, logger="prefill_router.discovery")
    await cluster.create(endpoint_slice("prefill-a", SERVICE, [endpoint("10.0.0.1", "pod-0")]))
    # the first watch sees nothing of what follows, then ends the way `ending` says
    kmock[kmock.action.WATCH][:1] << reaction(discover.gate)
    silent = ending == "goes_silent"
    discovery, calls = discover(**({"watch_timeout_s": 0.2} if silent else {}))
    await eventually(lambda: calls and len(kmock[kmock.action.WATCH]) == 1)
    await cluster.delete("prefill-a")
    await cluster.create(endpoint_slice("prefill-b", SERVICE, [endpoint("10.0.0.2", "pod-1")]))
    if not silent:
        discover.gate.set()
    await eventually(lambda: len(calls) == 2)
    await eventually(lambda: watch_subscribed(kmock))  # the second watch is kmock's own
    await cluster.create(endpoint_slice("prefill-c", SERVICE, [endpoint("10.0.0.3", "pod-2")]))
    await eventually(lambda: len(calls) == 3)
    assert calls == [
        pipelines(("pod-0", "10.0.0.1:50051")),
        pipelines(("pod-1", "10.0.0.2:50051")),
        pipelines(("pod-1", "10.0.0.2:50051"), ("pod-2", "10.0.0.3:50051")),
    ]
    lists = len(kmock[kmock.action.LIST])
    assert lists >= 2 if silent else lists == 2
    relisted = [r.getMessage() for r in caplog.records if "re-listing" in r.getMessage()]
    if logged is None:
        assert relisted == []  # a clean end re-lists at once, no error, no backoff
    else:
        assert logged in relisted[0] and (len(relisted) == 1 or silent), relisted


@pytest.mark.asyncio
async def test_a_failed_list_is_retried(kmock, cluster, discover) -> None:
    await cluster.create(endpoint_slice("prefill-a", SERVICE, [endpoint("10.0.0.1", "pod-0")]))
    kmock[kmock.action.LIST][:1] << 503
    discovery, calls = discover()
    await eventually(lambda: calls)
    assert calls == [pipelines(("pod-0", "10.0.0.1:50051"))]
    assert len(kmock[kmock.action.LIST]) == 2


def discovery_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("discovery-")]


@pytest.mark.asyncio
async def test_stop_ends_a_live_watch_promptly(kmock, cluster, discover) -> None:
    await cluster.create(endpoint_slice("prefill-a", SERVICE, [endpoint("10.0.0.1", "pod-0")]))
    discovery, calls = discover()
    await eventually(lambda: calls and watch_subscribed(kmock))
    started = time.monotonic()
    await asyncio.to_thread(discovery.stop)
    assert time.monotonic() - started < 1.0
    assert discovery_threads() == []
    assert discovery.current() == pipelines(("pod-0", "10.0.0.1:50051"))


@pytest.mark.asyncio
async def test_stop_interrupts_a_backoff(kmock, cluster, discover) -> None:
    kmock[kmock.action.LIST] << 503
    discovery, calls = discover(backoff_initial_s=30.0, backoff_max_s=30.0)
    await eventually(lambda: len(kmock[kmock.action.LIST]) == 1)
    started = time.monotonic()
    await asyncio.to_thread(discovery.stop)
    assert time.monotonic() - started < 1.0
    assert discovery_threads() == []
    assert calls == []
