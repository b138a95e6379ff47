"""`model.source: huggingface`: an init container in every pod downloads the checkpoint from the
Hub into the pod's model volume (routers and gateways only its config and tokenizer), with the
token from a Secret; the main containers mount it read-only where `--model` points."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helm_harness import command_line, container_env, merge, parse, render, render_result

HF = {
    "model": {
        "source": "huggingface",
        "huggingface": {
            "id": "Qwen/Qwen3-0.6B",
            "revision": "c1899de",
            "tokenSecret": {"name": "hf-token", "key": "hub"},
        },
    },
    "gateway": {"enabled": True, "decode": {"urls": ["d:8000"]}},
}
STUB = """
import json, os, pathlib
def snapshot_download(repo_id, revision, local_dir, allow_patterns):
    call = {"repo_id": repo_id, "revision": revision, "local_dir": local_dir,
            "allow_patterns": allow_patterns, "token": os.environ.get("HF_TOKEN"),
            "hf_home": os.environ.get("HF_HOME")}
    pathlib.Path(os.environ["STUB_RECORD"]).write_text(json.dumps(call))
    return local_dir
"""


@pytest.mark.parametrize("layout", ["podPerStage", "podPerPipeline"])
def test_every_pod_downloads_what_it_reads_into_a_read_only_model_volume(layout) -> None:
    manifest = render(merge(HF, {"pipelines": {"layout": layout}}))
    for component in ("leader", "stage", "router", "gateway"):
        if component == "stage" and layout == "podPerPipeline":
            assert not manifest.pods_of("stage")
            continue
        (pod, *_) = manifest.pods_of(component)
        (init,) = pod.spec["initContainers"]
        assert init["name"] == "download-model"
        repo, revision, path, files = init["args"][1:]
        assert (repo, revision, path) == ("Qwen/Qwen3-0.6B", "c1899de", "/models/checkpoint")
        reads_weights = component in ("leader", "stage")
        assert (files == "") == reads_weights
        if not reads_weights:
            assert set(files.split(",")) >= {
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
            }
            assert not any("safetensors" in f for f in files.split(","))
        assert {"name": "model", "mountPath": path} in init["volumeMounts"]
        main = pod.container()
        (mount,) = [m for m in main["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": path, "readOnly": True}
        (volume,) = [v for v in pod.spec["volumes"] if v["name"] == "model"]
        assert volume["emptyDir"]["sizeLimit"] == ("64Gi" if reads_weights else "64Mi")
        if component in ("leader", "router", "gateway"):
            assert str(parse(main).model) == path
        token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "hub"}


def test_the_download_command_calls_snapshot_download_with_the_rendered_values(tmp_path) -> None:
    """The init container's rendered command, run with huggingface_hub replaced by a recorder
    (no Hub here): arguments, file patterns and the token reach snapshot_download."""
    (tmp_path / "stub" / "huggingface_hub").mkdir(parents=True)
    (tmp_path / "stub" / "huggingface_hub" / "__init__.py").write_text(STUB)
    manifest = render(HF)
    for component, patterns in (("leader", None), ("router", ["config.json"])):
        (pod,) = manifest.pods_of(component)[:1]
        (init,) = pod.spec["initContainers"]
        plain = {**init, "env": [e for e in init["env"] if e["name"] != "HF_TOKEN"]}
        env = container_env(plain, pod.name)  # HF_TOKEN: kubelet reads the Secret
        env.update(HF_TOKEN="hf_secret", PYTHONPATH=str(tmp_path / "stub"))
        env["STUB_RECORD"] = str(tmp_path / f"{component}.json")
        argv = command_line(init, env)
        argv[0] = sys.executable
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        call = json.loads((tmp_path / f"{component}.json").read_text())
        assert call["repo_id"] == "Qwen/Qwen3-0.6B" and call["revision"] == "c1899de"
        assert call["local_dir"] == "/models/checkpoint" and call["token"] == "hf_secret"
        assert call["hf_home"] == "/tmp/huggingface"
        if patterns is None:
            assert call["allow_patterns"] is None
        else:
            assert set(patterns) <= set(call["allow_patterns"])


def test_a_huggingface_source_without_an_id_is_refused() -> None:
    code, _, err = render_result({"model": {"source": "huggingface"}})
    assert code != 0 and "/model/huggingface/id" in err, err
