"""Pipeline discovery: the set of pipeline leaders' gRPC addresses, static or from Kubernetes."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prefill_node.errors import InvalidRequestError, InvariantError

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_CONNECT_TIMEOUT_S = 5.0
_LIST_READ_TIMEOUT_S = 30.0
_WATCH_READ_GRACE_S = 1.0
_STOP_POLL_S = 0.05


class InvalidDiscoveryConfigError(InvalidRequestError):
    """A discovery setting (service, namespace, timing) is empty or out of range."""


class InvalidPipelineAddressError(InvalidDiscoveryConfigError):
    """A static pipeline address is not ``host:port``."""


@dataclass(frozen=True, slots=True)
class PipelineEndpoint:
    """One pipeline leader. ``id`` is stable for the endpoint across address changes where the
    source allows it (Kubernetes: its pod name, else ``ip:port``; static: the address);
    ``address`` is the ``host:port`` to dial (IPv6 hosts in brackets)."""

    id: str
    address: str


OnChange = Callable[[frozenset[PipelineEndpoint]], None]


class PipelineDiscovery(Protocol):
    """The contract both discoveries keep.

    ``start(on_change)`` once: ``on_change`` gets the FULL current set (never a delta) after
    the first sync, even if empty, then each time the set changes; calls never overlap.
    ``current()`` is safe from any thread and returns the last set passed to ``on_change``
    (empty before the first sync). ``stop()`` is idempotent; after it returns no new
    ``on_change`` call starts.
    """

    def start(self, on_change: OnChange) -> None: ...

    def current(self) -> frozenset[PipelineEndpoint]: ...

    def stop(self) -> None: ...


def validate_address(address: str) -> str:
    """Return ``address`` if it is ``host:port`` (IPv6 as ``[::1]:port``, port 1-65535), else
    raise ``InvalidPipelineAddressError`` saying what to fix."""
    problem = _address_problem(address)
    if problem is not None:
        raise InvalidPipelineAddressError(f"pipeline address {address!r} {problem}")
    return address


def _address_problem(address: object) -> str | None:
    if not isinstance(address, str) or not address:
        return "is empty: give host:port"
    if "://" in address:
        return "has a scheme: give host:port, e.g. 10.0.0.5:50051"
    if any(c.isspace() for c in address):
        return "holds whitespace: give host:port"
    host, _, port = address.rpartition(":")
    if not host or not port:
        return "lacks a host or a port: give host:port"
    if host.startswith("[") and (not host.endswith("]") or ":" not in host):
        return "needs an IPv6 host as [addr]:port, e.g. [::1]:50051"
    if ":" in host and not host.startswith("["):
        return "needs its IPv6 host in brackets, e.g. [::1]:50051"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return "needs a port number in 1-65535"
    return None


def own_namespace() -> str:
    """The pod's namespace (its service account mount), else "default" (outside a cluster)."""
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.is_file() else "default"


def _join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class StaticDiscovery:
    """A fixed list of pipeline addresses (local runs). Keeps the ``PipelineDiscovery``
    contract; ``start`` calls ``on_change`` once, synchronously, on the caller's thread, and
    there is no thread. Raises ``InvalidPipelineAddressError`` on an empty list, a bad or a
    repeated address."""

    def __init__(self, addresses: Sequence[str]) -> None:
        if isinstance(addresses, str):
            raise InvalidPipelineAddressError(
                f"give a list of host:port addresses, not the string {addresses!r}"
            )
        if not addresses:
            raise InvalidPipelineAddressError("no pipeline addresses: give at least one host:port")
        seen: set[str] = set()
        for address in addresses:
            if validate_address(address) in seen:
                raise InvalidPipelineAddressError(
                    f"pipeline address {address!r} is listed twice: list each pipeline once"
                )
            seen.add(address)
        self._endpoints = frozenset(PipelineEndpoint(a, a) for a in addresses)
        self._started = False

    def start(self, on_change: OnChange) -> None:
        if self._started:
            raise InvariantError("StaticDiscovery.start() called twice")
        self._started = True
        on_change(self._endpoints)

    def current(self) -> frozenset[PipelineEndpoint]:
        return self._endpoints

    def stop(self) -> None:
        """Nothing to stop: there is no thread."""


class EndpointSliceDiscovery:
    """Pipelines = the ready endpoints of a Kubernetes Service, from its EndpointSlices
    (discovery.k8s.io/v1, list + watch with the official client).

    An endpoint is a pipeline when ``conditions.ready`` is not false (unset counts as ready,
    as the API says) and its slice has the port named ``port_name`` (the slice's only port
    when ``port_name`` is None); its address is the endpoint's first address. An id seen in
    two slices (dual stack) keeps the smallest address.

    Threading: ``start`` spawns one daemon thread that lists, then watches; ``on_change`` is
    called only from that thread (never concurrently, exceptions logged and swallowed).
    Any watch end re-lists and REPLACES the state: a clean end or a server that ignores the
    timeout (no byte for ``watch_timeout_s`` + 1 s) or 410 Gone re-lists at once; any other
    error re-lists after a backoff doubling from ``backoff_initial_s`` to ``backoff_max_s``
    (reset by a successful list). ``stop`` shuts the watch's socket and joins the thread
    within ``stop_timeout_s`` (a list stuck in a silent server can outlast that; the
    thread is a daemon and reports nothing more). ``api_client`` None: in-cluster
    credentials, else the local kubeconfig, loaded in ``start`` (kubernetes'
    ``ConfigException`` if neither exists).
    """

    def __init__(
        self,
        service: str,
        namespace: str,
        port_name: str | None = "grpc",
        api_client: Any = None,
        *,
        watch_timeout_s: float = 300.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        stop_timeout_s: float = 5.0,
    ) -> None:
        if not service or not namespace:
            raise InvalidDiscoveryConfigError(
                f"service {service!r} / namespace {namespace!r}: name both, non-empty"
            )
        timings = (watch_timeout_s, backoff_initial_s, backoff_max_s, stop_timeout_s)
        if min(timings) <= 0 or backoff_max_s < backoff_initial_s:
            raise InvalidDiscoveryConfigError(
                f"discovery timings {timings} must be positive, backoff_max_s >= initial"
            )
        self._service, self._namespace, self._port_name = service, namespace, port_name
        self._name = f"{namespace}/{service}"
        self._api_client = api_client
        self._watch_timeout_s, self._stop_timeout_s = watch_timeout_s, stop_timeout_s
        self._backoff_initial_s, self._backoff_max_s = backoff_initial_s, backoff_max_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._current: frozenset[PipelineEndpoint] = frozenset()
        self._synced = False
        self._slices: dict[str, frozenset[PipelineEndpoint]] = {}  # discovery thread only
        self._watch: Any = None  # the live kubernetes.watch.Watch, for stop()
        self._api: Any = None  # DiscoveryV1Api, made in start()
        self._thread: threading.Thread | None = None
        self._on_change: OnChange | None = None

    def start(self, on_change: OnChange) -> None:
        if self._thread is not None:
            raise InvariantError("EndpointSliceDiscovery.start() called twice")
        from kubernetes import client, config

        if self._api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api_client = client.ApiClient()
        self._api = client.DiscoveryV1Api(self._api_client)
        self._on_change = on_change
        self._thread = threading.Thread(
            target=self._run, name=f"discovery-{self._name}", daemon=True
        )
        self._thread.start()

    def current(self) -> frozenset[PipelineEndpoint]:
        with self._lock:
            return self._current

    def stop(self) -> None:
        self._stopping.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        deadline = time.monotonic() + self._stop_timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            with self._lock:
                watch = self._watch
            if watch is not None:
                watch.stop()  # shuts the socket down; repeated until the stream has one
            thread.join(_STOP_POLL_S)
        if thread.is_alive():
            logger.warning(
                "discovery of %s did not stop in %.1f s", self._name, self._stop_timeout_s
            )

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import ReadTimeoutError

        backoff = self._backoff_initial_s
        while not self._stopping.is_set():
            try:
                resource_version = self._resync()
                backoff = self._backoff_initial_s
                self._watch_from(resource_version)
            except Exception as error:  # any disconnect or bad reply: re-list, never die
                expired = isinstance(error, ReadTimeoutError) or (
                    isinstance(error, ApiException) and error.status == 410
                )
                if expired:
                    logger.info(
                        "watch of %s expired (%s); re-listing", self._name, _describe(error)
                    )
                    continue
                self._back_off(error, backoff)
                backoff = min(2 * backoff, self._backoff_max_s)

    def _back_off(self, error: Exception, delay_s: float) -> None:
        if not self._stopping.is_set():
            logger.warning(
                "discovery of %s failed (%s); re-listing in %.2f s",
                self._name,
                _describe(error),
                delay_s,
            )
            self._stopping.wait(delay_s)

    def _resync(self) -> str | None:
        """List the Service's slices and replace the whole state with them."""
        reply = self._api.list_namespaced_endpoint_slice(
            self._namespace,
            label_selector=f"{SERVICE_NAME_LABEL}={self._service}",
            _request_timeout=(_CONNECT_TIMEOUT_S, _LIST_READ_TIMEOUT_S),
        )
        self._slices = {
            s.metadata.name: self._slice_endpoints(s) for s in reply.items if self._is_ours(s)
        }
        self._publish()
        return reply.metadata.resource_version if reply.metadata else None

    # What kmock (the test emulator) does not cover, so the code does not rely on it: it
    # ignores label selectors (hence _is_ours), sets no resourceVersion (its list says '...'),
    # ignores timeoutSeconds (hence the client-side read timeout), replays ADDED for every
    # existing slice at each watch start (hence idempotent _apply), and never sends BOOKMARK
    # or an expiry on its own (the tests inject ends, 410 and errors with reactions).
    def _watch_from(self, resource_version: str | None) -> None:
        from kubernetes import watch

        stream_watch = watch.Watch()
        with self._lock:
            self._watch = stream_watch
        try:
            if self._stopping.is_set():
                return
            extra = {"resource_version": resource_version} if resource_version else {}
            events = stream_watch.stream(
                self._api.list_namespaced_endpoint_slice,
                self._namespace,
                label_selector=f"{SERVICE_NAME_LABEL}={self._service}",
                timeout_seconds=math.ceil(self._watch_timeout_s),
                allow_watch_bookmarks=True,
                _request_timeout=(_CONNECT_TIMEOUT_S, self._watch_timeout_s + _WATCH_READ_GRACE_S),
                **extra,
            )
            for event in events:
                if self._stopping.is_set():
                    return
                self._apply(event["type"], event["object"])
        finally:
            with self._lock:
                self._watch = None

    def _apply(self, kind: str, endpoint_slice: Any) -> None:
        """Apply one watch event idempotently: ADDED or MODIFIED replaces the slice (kmock
        and a re-watch replay ADDED for known slices), DELETED drops it."""
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return  # BOOKMARK: nothing to apply (ERROR is raised by the client)
        name = endpoint_slice.metadata.name
        if kind == "DELETED" or not self._is_ours(endpoint_slice):
            self._slices.pop(name, None)  # a re-labelled slice leaves the Service
        else:
            self._slices[name] = self._slice_endpoints(endpoint_slice)
        self._publish()

    def _is_ours(self, endpoint_slice: Any) -> bool:
        # The server filters by label selector already; kmock ignores selectors, and a slice
        # re-labelled away arrives as MODIFIED, so check the label here too.
        labels = endpoint_slice.metadata.labels or {}
        return labels.get(SERVICE_NAME_LABEL) == self._service

    def _slice_endpoints(self, endpoint_slice: Any) -> frozenset[PipelineEndpoint]:
        ports = endpoint_slice.ports or []
        if self._port_name is None:
            port = ports[0].port if len(ports) == 1 else None
        else:
            port = next((p.port for p in ports if p.name == self._port_name), None)
        if port is None:
            return frozenset()
        found = set()
        for endpoint in endpoint_slice.endpoints or []:
            conditions = endpoint.conditions
            if (conditions is not None and conditions.ready is False) or not endpoint.addresses:
                continue
            address = _join_host_port(endpoint.addresses[0], port)
            ref = endpoint.target_ref
            found.add(
                PipelineEndpoint(ref.name if ref is not None and ref.name else address, address)
            )
        return frozenset(found)

    def _publish(self) -> None:
        endpoints = _merge_by_id(self._slices.values())
        with self._lock:
            if self._stopping.is_set() or (self._synced and endpoints == self._current):
                return
            self._current, self._synced = endpoints, True
        logger.info("pipelines of %s: %s", self._name, sorted(e.address for e in endpoints))
        on_change = self._on_change
        if on_change is None:
            raise InvariantError("discovery thread running before start() set on_change")
        try:
            on_change(endpoints)
        except Exception:
            logger.exception("on_change of the discovery of %s raised", self._name)


def _merge_by_id(slices: Iterable[frozenset[PipelineEndpoint]]) -> frozenset[PipelineEndpoint]:
    by_id: dict[str, PipelineEndpoint] = {}
    for endpoints in slices:
        for endpoint in endpoints:
            kept = by_id.get(endpoint.id)
            if kept is None or endpoint.address < kept.address:
                by_id[endpoint.id] = endpoint
    return frozenset(by_id.values())


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
