"""Render -> run: the chart's StatefulSet variant (1 pipeline x 2 stages + router), and its
podPerPipeline layout (one pod running both stages), started here
as local processes with exactly the rendered commands, args, env and ports, this test playing
kubelet (fieldRefs, $(VAR) expansion, volumes as local directories, cluster DNS names as
127.0.0.1, gRPC probes) and the EndpointSlice controller: the router discovers the leader from
kmock's API with the real kubernetes client, as in a cluster. A Prefill through the router must
give the first token of an in-process engine on the same checkpoint.

The router's init container runs too: it copies the checkpoint's config (and tokenizer files,
test_router_init_container_copies_only_what_the_router_reads) into the router's own small
volume, which is all the router mounts, and the router serves from that.

What this cannot run: the init container of the bundled model (the checkpoint here is a tiny
random one on a hostPath; test_bundled_model_init_container runs that command on its own),
RBAC (kmock authorises everything) and the image itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client

from prefill_node.client.prefill_client import PrefillClient
from prefill_node.engine.types import PrefillOptions
from prefill_node.model.default_model import DEFAULT_MODEL_DIRNAME, is_complete
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights
from prefill_node.runtime.dist_env import free_local_port
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine
from tests.helm_harness import (
    CLUSTER_DNS,
    NAMESPACE,
    Manifest,
    Pod,
    command_line,
    container_env,
    port_number,
    render,
)
from tests.tiny_models import tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = tiny_llama("tiny-helm", max_position_embeddings=256)  # vocab 64
HOST_MODEL = "/srv/models/tiny-helm"  # the hostPath in the rendered chart
VENV_BIN = Path(sys.executable).parent


class Kubelet:
    """Runs rendered containers as local processes: volumes become directories under ``root``
    (a hostPath the one the test maps it to; /dev/shm stays the real one), the pod IP is
    127.0.0.1 and a cluster DNS name resolves to it."""

    def __init__(self, root: Path, host_paths: dict[str, Path]) -> None:
        self.root, self.host_paths = root, host_paths
        self.procs: dict[str, subprocess.Popen] = {}

    def mounts(self, pod: Pod, container: dict) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        found = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                found[mount["mountPath"]] = self.host_paths[volume["hostPath"]["path"]]
            elif "emptyDir" in volume and mount["mountPath"] != "/dev/shm":
                # named as the mount point is: a model's identity may be its directory's name
                local = self.root / pod.name / mount["name"] / Path(mount["mountPath"]).name
                local.mkdir(parents=True, exist_ok=True)
                found[mount["mountPath"]] = local
            else:
                assert mount["mountPath"] == "/dev/shm", f"no local stand-in for {volume}"
        return found

    def command(self, pod: Pod, container: dict, extra_env: dict[str, str] | None = None):
        mounts = self.mounts(pod, container)

        paths = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
        under_mount = re.compile(rf"(?<![\w./-])({paths})(?=/|$)")

        def local(text: str) -> str:  # one pass: a replacement is never rewritten again
            text = CLUSTER_DNS.sub("127.0.0.1", text)
            return under_mount.sub(lambda m: str(mounts[m.group(1)]), text) if mounts else text

        env = {k: local(v) for k, v in container_env(container, pod.name).items()}
        base = {
            "PATH": f"{VENV_BIN}:/usr/bin:/bin",
            "HOSTNAME": pod.name,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        env = {**base, **env, **(extra_env or {})}
        return [local(arg) for arg in command_line(container, env)], env

    def start(self, pod: Pod, extra_env: dict[str, str] | None = None) -> None:
        for init in pod.spec.get("initContainers", []):
            argv, env = self.command(pod, init, extra_env)
            subprocess.run(argv, env=env, cwd=self.root, check=True, timeout=120)
        argv, env = self.command(pod, pod.container(), extra_env)
        with open(self.root / f"{pod.name}.log", "w") as log:  # the child keeps its own copy
            self.procs[pod.name] = subprocess.Popen(
                argv, env=env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- {name} (rc {p.poll()}):\n{(self.root / f'{name}.log').read_text()[-3000:]}"
            for name, p in self.procs.items()
        )

    def stop(self, name: str, timeout_s: float = 30) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def probe(pod: Pod, kind: str) -> bool:
    """One gRPC health probe as kubelet sends it (the pod IP is 127.0.0.1)."""
    spec = pod.container()[kind]["grpc"]
    with grpc.insecure_channel(f"127.0.0.1:{spec['port']}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=spec["service"]), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def eventually(kubelet: Kubelet, predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        dead = [n for n, p in kubelet.procs.items() if p.poll() is not None]
        assert not dead, f"{dead} exited while waiting for {what}\n{kubelet.logs()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{kubelet.logs()}"
        time.sleep(0.2)


def endpoint_slice(service: dict, pods: list[Pod], suffix: str = "local") -> dict:
    """What the EndpointSlice controller publishes for ``service`` with ``pods`` ready."""
    name = service["metadata"]["name"]
    ports = [
        {
            "name": p["name"],
            "port": port_number(pods[0].container(), p["targetPort"]),
            "protocol": "TCP",
        }
        for p in service["spec"]["ports"]
    ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-{suffix}",
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": [
            {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": True},
                "targetRef": {"kind": "Pod", "name": p.name, "namespace": NAMESPACE},
            }
            for p in pods
        ],
    }


def kubeconfig(path: Path, server: str) -> Path:
    """What the router's in-cluster credentials would give it: the API server's address."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "local",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "router", "user": {"token": "local"}}],
                "contexts": [{"name": "local", "context": {"cluster": "kmock", "user": "router"}}],
            }
        )
    )
    return path


def rendered_chart(
    layout: str = "podPerStage", num_blocks: str = "128", min_ready_s: int = 10
) -> Manifest:
    return render(
        {
            # the model's directory name is its identity (no _name_or_path): the router's
            # copy of its config must stand at a path of the same name, as in a cluster
            "model": {"source": "hostPath", "hostPath": HOST_MODEL, "mountPath": "/m/tiny-helm"},
            "pipelines": {
                "layout": layout,
                "kind": "StatefulSet",
                "replicas": 1,
                "stages": 2,
                "numBlocks": num_blocks,
                "minReadySeconds": min_ready_s,
                "blockSize": 4,
                "maxChunkTokens": 16,
                "threads": 1,
                "port": free_local_port(),
                "metricsPort": free_local_port(),
                "rendezvousPort": free_local_port(),
            },
            "router": {
                "port": free_local_port(),
                "metricsPort": free_local_port(),
                "pollIntervalSeconds": 0.2,
            },
            "grpc": {"logLevel": "WARNING"},
        }
    )


def scrape(pod: Pod) -> str:
    notes = pod.template["metadata"]["annotations"]
    url = f"http://127.0.0.1:{notes['prometheus.io/port']}{notes['prometheus.io/path']}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["podPerStage", "podPerPipeline"])
async def test_rendered_pipeline_serves_a_prefill_through_the_router(
    kmock, tmp_path, layout
) -> None:
    """podPerStage: the StatefulSet leader and stage pods; podPerPipeline: the Deployment's
    one pod, whose `wavepp serve --stages 2` launches its stage itself."""
    model_dir = tmp_path / "tiny-helm"
    save_hf_checkpoint(model_dir, MODEL, random_weights(MODEL, seed=14))
    prompt = [(7 * i + 3) % 64 for i in range(41)]
    direct = LocalEngine.from_model_dir(
        EngineConfig(
            model_dir=model_dir, stages=2, num_blocks=128, block_size=4, max_wave_tokens=16
        )
    )
    want = direct.submit(prompt, PrefillOptions(top_logprobs=5)).result()

    manifest = rendered_chart(layout)
    (leader,), stages, (router,) = (manifest.pods_of(c) for c in ("leader", "stage", "router"))
    assert len(stages) == (1 if layout == "podPerStage" else 0)
    kmock.resources["discovery.k8s.io/v1/endpointslices"] = {}
    api_server = str(kmock.url).rstrip("/")
    api = client.DiscoveryV1Api(client.ApiClient(client.Configuration(host=api_server)))
    kubelet = Kubelet(tmp_path, {HOST_MODEL: model_dir})
    try:
        kubelet.start(leader)
        for stage in stages:
            kubelet.start(stage)
        await asyncio.to_thread(
            eventually,
            kubelet,
            lambda: probe(leader, "readinessProbe"),
            180,
            "the leader's readiness probe",
        )
        for service in manifest.all("Service"):  # the EndpointSlice controller's part
            if leader in manifest.selected_by(service):  # the one pod ready by now
                body = endpoint_slice(service, [leader])
                await asyncio.to_thread(api.create_namespaced_endpoint_slice, NAMESPACE, body)
        config = kubeconfig(tmp_path / "kubeconfig", api_server)
        kubelet.start(router, {"KUBECONFIG": str(config)})
        await asyncio.to_thread(
            eventually,
            kubelet,
            lambda: probe(router, "readinessProbe"),
            120,
            "the router's readiness probe",
        )
        router_port = port_number(router.container(), "grpc")
        with PrefillClient(f"127.0.0.1:{router_port}") as via_router:
            remote = await asyncio.to_thread(via_router.prefill, prompt, top_logprobs=5)
        got = remote.result
        assert got.first_token_id == want.first_token_id
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        assert got.served_by == leader.name  # the pipeline id discovery took from the slice
        for pod in (leader, router):
            assert "# HELP wavepp_" in await asyncio.to_thread(scrape, pod)
        assert kubelet.stop(router.name) == 0
        assert kubelet.stop(leader.name) == 0  # SIGTERM: drain, stop the stage, exit cleanly
        for stage in stages:
            assert kubelet.procs[stage.name].wait(timeout=30) == 0, kubelet.logs()
    finally:
        for name in kubelet.procs:
            kubelet.stop(name, timeout_s=5)


def test_bundled_model_init_container_prepares_the_model_in_the_pods_cache(
    default_model_cache, tmp_path
) -> None:
    """The init container's rendered command, with the pod's cache volume standing at the
    session's converted default model (so this costs nothing after the first conversion)."""
    cache_dir, _ = default_model_cache
    (leader,) = render().pods_of("leader")
    (init,) = leader.spec["initContainers"]
    kubelet = Kubelet(tmp_path, {})
    argv, env = kubelet.command(leader, init)
    env["WAVEPP_CACHE_DIR"] = str(cache_dir)  # the emptyDir, shared with the session's tests
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert is_complete(cache_dir / "models" / DEFAULT_MODEL_DIRNAME)
    assert f"{cache_dir}/models/{DEFAULT_MODEL_DIRNAME}" in done.stdout


def test_router_init_container_copies_only_what_the_router_reads(
    default_model_dir, tmp_path
) -> None:
    """The router's `copy-model-files`, run on the real default checkpoint (weights, config,
    tokenizer with a chat template) on a hostPath: the router's volume gets the config and
    tokenizer files and no weights, and what the router loads from it (prefill_node/cli/
    router.py: load_hf_config, Tokenizer.from_dir) is what it would load from the checkpoint."""
    from prefill_node.model.loader_hf import load_hf_config
    from prefill_node.model.tokenizer import Tokenizer

    values = {"model": {"source": "hostPath", "hostPath": "/srv/models/smollm2"}}
    (router,) = render(values).pods_of("router")
    (init,) = router.spec["initContainers"]
    assert init["name"] == "copy-model-files"
    # the router container mounts the copy, never the checkpoint
    volumes = {v["name"]: v for v in router.spec["volumes"]}
    (mount,) = [m for m in router.container()["volumeMounts"] if m["name"] == "model"]
    assert "emptyDir" in volumes["model"] and mount["readOnly"]
    assert [m["name"] for m in init["volumeMounts"]] == ["model-source", "model"]
    kubelet = Kubelet(tmp_path, {"/srv/models/smollm2": default_model_dir})
    argv, env = kubelet.command(router, init)
    argv[0] = sys.executable
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (copy,) = [
        p for m, p in kubelet.mounts(router, router.container()).items() if m == mount["mountPath"]
    ]
    copied = {f.name for f in copy.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= copied
    assert not {f for f in copied if f.endswith((".safetensors", ".gguf", ".bin"))}, copied
    assert copied <= {f.name for f in default_model_dir.iterdir()} - {"wavepp_conversion.json"}
    whole, trimmed = load_hf_config(default_model_dir), load_hf_config(copy)
    assert trimmed == whole
    tokenizer = Tokenizer.from_dir(copy)
    assert tokenizer.has_chat_template
    text = "What is the capital of France?"
    assert tokenizer.encode(text) == Tokenizer.from_dir(default_model_dir).encode(text)
    # a directory that is no checkpoint fails the init container, naming it
    empty = tmp_path / "empty"
    empty.mkdir()
    kubelet = Kubelet(tmp_path / "again", {"/srv/models/smollm2": empty})
    argv, env = kubelet.command(router, init)
    argv[0] = sys.executable
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no config.json in the checkpoint" in done.stderr


def router_ready_on(router_port: int, pod: Pod) -> bool:
    """The router behind ``router_port`` holds ``pod``'s pipeline as ready."""
    address = f"127.0.0.1:{port_number(pod.container(), 'grpc')}"
    with PrefillClient(f"127.0.0.1:{router_port}") as router:
        load = router.load(timeout_s=5)
    return any(p.ready and p.address == address for p in load.pipelines)


@pytest.mark.asyncio
async def test_a_pod_per_pipeline_roll_keeps_the_router_serving(kmock, tmp_path) -> None:
    """Revision 1 (two podPerPipeline pipelines) runs behind the router; revision 2 (another
    KV size: a new pipeline revision) replaces them one at a time in the order the Deployment
    controller uses with maxUnavailable 1, maxSurge 0: the old pod leaves the EndpointSlice and
    drains (SIGTERM), the new one starts and joins once its readiness probe passes, and the
    next old pod goes after `minReadySeconds`, in which the router takes the new one in. A client
    prefilling through the router all along sees no error, and ends on revision 2 only.
    Each pod's ports come from its own render: on 127.0.0.1 they stand for pod IPs."""
    model_dir = tmp_path / "tiny-helm"
    save_hf_checkpoint(model_dir, MODEL, random_weights(MODEL, seed=15))
    prompt = [(5 * i + 1) % 64 for i in range(23)]
    direct = LocalEngine.from_model_dir(
        EngineConfig(
            model_dir=model_dir, stages=2, num_blocks=128, block_size=4, max_wave_tokens=16
        )
    )
    want = direct.submit(prompt, PrefillOptions()).result().first_token_id

    def revision(tag: str, num_blocks: str, i: int) -> tuple[Manifest, Pod]:
        manifest = rendered_chart("podPerPipeline", num_blocks, min_ready_s=5)
        (leader,) = manifest.pods_of("leader")
        return manifest, dataclasses.replace(leader, name=f"pipeline-{tag}-{i}")

    old = [revision("r1", "128", i) for i in range(2)]
    new = [revision("r2", "96", i) for i in range(2)]
    argv = lambda pod: command_line(pod.container(), container_env(pod.container(), pod.name))
    assert "--num-blocks=128" in argv(old[0][1]) and "--num-blocks=96" in argv(new[0][1])
    manifest = old[0][0]
    (deployment,) = [
        d for d in manifest.all("Deployment") if d["metadata"]["name"].endswith("-pipeline")
    ]
    min_ready_s = deployment["spec"]["minReadySeconds"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    (service,) = [
        s for s in manifest.all("Service") if s["metadata"]["name"].endswith("-pipelines")
    ]
    (router,) = manifest.pods_of("router")
    kmock.resources["discovery.k8s.io/v1/endpointslices"] = {}
    api_server = str(kmock.url).rstrip("/")
    api = client.DiscoveryV1Api(client.ApiClient(client.Configuration(host=api_server)))
    kubelet = Kubelet(tmp_path, {HOST_MODEL: model_dir})

    async def start_ready(pod: Pod) -> None:
        kubelet.start(pod)
        await asyncio.to_thread(
            eventually, kubelet, lambda: probe(pod, "readinessProbe"), 180, f"{pod.name} ready"
        )
        body = endpoint_slice(service, [pod], suffix=pod.name)
        await asyncio.to_thread(api.create_namespaced_endpoint_slice, NAMESPACE, body)

    answers: list[tuple[str, int]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client_loop(port: int) -> None:
        with PrefillClient(f"127.0.0.1:{port}") as via_router:
            while not stop.is_set():
                try:
                    salt = str(len(answers))  # a new prefix each time: every call computes
                    result = via_router.prefill(prompt, cache_salt=salt, deadline_s=30).result
                    answers.append((result.served_by, result.first_token_id))
                except Exception as exc:  # noqa: BLE001 - any failure is the test's finding
                    errors.append(repr(exc))
                time.sleep(0.1)

    try:
        for _, pod in old:
            await start_ready(pod)
        kubelet.start(router, {"KUBECONFIG": str(kubeconfig(tmp_path / "kc", api_server))})
        await asyncio.to_thread(
            eventually, kubelet, lambda: probe(router, "readinessProbe"), 120, "router ready"
        )
        router_port = port_number(router.container(), "grpc")
        loop = threading.Thread(target=client_loop, args=(router_port,))
        loop.start()
        await asyncio.to_thread(eventually, kubelet, lambda: len(answers) >= 3, 60, "serving")
        for (_, before), (_, after) in zip(old, new, strict=True):
            name = f"{service['metadata']['name']}-{before.name}"
            await asyncio.to_thread(api.delete_namespaced_endpoint_slice, name, NAMESPACE)
            assert kubelet.stop(before.name) == 0, kubelet.logs()  # drains, stops its stage
            del kubelet.procs[before.name]  # gone, as the old pod is
            await start_ready(after)
            # the controller waits minReadySeconds before the next old pod goes; the router
            # must have taken the new pipeline in by then, which is what the wait is for:
            # wait for exactly that (a loaded machine may need longer than the seconds)
            await asyncio.to_thread(
                eventually, kubelet, functools.partial(router_ready_on, router_port, after), 60,
                f"the router routing to {after.name}",
            )  # fmt: skip
            await asyncio.sleep(min_ready_s)
        served_before_last = len(answers)
        await asyncio.to_thread(
            eventually, kubelet, lambda: len(answers) >= served_before_last + 5, 60, "answers"
        )
        stop.set()
        loop.join(timeout=30)
        assert not errors, errors
        assert {token for _, token in answers} == {want}
        assert {by for by, _ in answers[-3:]} <= {pod.name for _, pod in new}
        assert old[0][1].name in {by for by, _ in answers}, answers
        # the pipeline that joined last is routed to on its own KV events: a prefix cached
        # there (prefilled on it directly) draws the router's request to it. (Fresh prefixes
        # alone need not: idle pipelines tie, and the faster-measured one takes them all.)
        last = new[-1][1]
        direct = PrefillClient(f"127.0.0.1:{port_number(last.container(), 'grpc')}")
        via_router = PrefillClient(f"127.0.0.1:{router_port}")
        with direct, via_router:
            await asyncio.to_thread(direct.prefill, prompt, cache_salt="last", deadline_s=30)
            scored_there = lambda: (
                via_router.score(prompt, cache_salt="last").pipeline_id == last.name
            )
            await asyncio.to_thread(eventually, kubelet, scored_there, 30, "the router indexing it")
            remote = await asyncio.to_thread(
                via_router.prefill, prompt, cache_salt="last", deadline_s=30
            )
        assert (remote.result.served_by, remote.result.first_token_id) == (last.name, want)
        assert remote.result.cached_tokens > 0
    finally:
        stop.set()
        for name in kubelet.procs:
            kubelet.stop(name, timeout_s=5)
