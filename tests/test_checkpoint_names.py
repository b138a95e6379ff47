"""Every naming transformers writes or reads loads: each tiny family saved by the installed
transformers (``save_pretrained``) and as transformers' in-memory state dict (fused experts,
Kimi's stacked convolutions and forget-gate module) loads through the stage loader and through
`wavepp prefill` on a 2-process pipeline, with transformers' own logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from prefill_node.errors import MissingTensorError
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.checkpoint_names import candidates
from prefill_node.model.config import ModelConfig
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.loader_hf import load_hf_config, load_stage_model, save_hf_checkpoint
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.weights import random_weights, weight_names
from tests.test_cli_prefill import wavepp
from tests.tiny_models import (
    TINY_LLAMA_HF,
    tiny_glm5,
    tiny_kimi,
    tiny_minimax_m2,
    tiny_qwen3,
    tiny_qwen3_next,
)

TOKENS = [3, 17, 9, 30, 4, 4, 52, 11, 0, 17, 23, 5, 40, 2]
FAMILIES = {
    "llama": lambda: ModelConfig.from_hf_config(TINY_LLAMA_HF, name="names-llama"),
    "qwen3": lambda: tiny_qwen3("names-qwen3", 256, vocab_size=64),
    "minimax_m2": tiny_minimax_m2,
    "glm_moe_dsa": tiny_glm5,
    "qwen3_next": tiny_qwen3_next,
    "kimi_linear": tiny_kimi,
}


def transformers_model(config: ModelConfig, tmp: Path) -> torch.nn.Module:
    """transformers' model holding our seeded random weights (loaded from our own layout)."""
    ours = tmp / "ours"
    save_hf_checkpoint(ours, config, random_weights(config, seed=11))
    return transformers.AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32).eval()


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


def pipeline_logits(path: Path, num_stages: int) -> torch.Tensor:
    config = load_hf_config(path)
    table = tuple(range(8))
    batch = ChunkBatch((ChunkSpec(0, len(TOKENS), table),))
    x = torch.tensor(TOKENS)
    for lr in split_layers(config.num_layers, num_stages):
        stage = load_stage_model(path, lr)
        x = stage(x, batch, stage_cache(stage.config, lr, 8, 4))
    return stage.compute_logits(x)


def state_dict_checkpoint(model: torch.nn.Module, path: Path) -> set[str]:
    """transformers' in-memory naming as a checkpoint (a plain ``state_dict`` save)."""
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    return set(state)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, transformers' logits, dir written by save_pretrained, state-dict dir)."""
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    model = transformers_model(FAMILIES[family](), tmp)
    model.save_pretrained(tmp / "saved")
    state_names = state_dict_checkpoint(model, tmp / "state")
    return family, logits_of(model), tmp / "saved", tmp / "state", state_names


def test_save_pretrained_checkpoint_loads_with_transformers_logits(saved):
    _, expected, path, _, _ = saved
    for stages in (1, 2):
        got = pipeline_logits(path, stages)
        assert torch.allclose(got, expected, atol=1e-4), (stages, (got - expected).abs().max())


def test_in_memory_state_dict_checkpoint_loads_with_transformers_logits(saved):
    family, expected, _, path, names = saved
    theirs = logits_of(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    )
    assert torch.allclose(theirs, expected, atol=1e-5)  # transformers reads it as it wrote it
    got = pipeline_logits(path, 2)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    if family in ("minimax_m2", "glm_moe_dsa", "qwen3_next", "kimi_linear"):
        assert any(n.endswith("experts.gate_up_proj") for n in names)  # the fused form ran


@pytest.mark.slow
def test_wavepp_prefill_loads_what_transformers_saved(saved):
    _, expected, path, _, _ = saved
    out = wavepp(
        "--model", str(path), "--stages", "2", "--no-chat", "--json",
        "--ids", ",".join(map(str, TOKENS)),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    logprobs = torch.log_softmax(expected[-1], dim=-1)
    assert row["first_token_id"] == int(logprobs.argmax())
    for token_id, logprob in row["top_logprobs"]:
        assert abs(logprob - float(logprobs[token_id])) < 1e-4


def test_a_missing_tensor_names_every_place_tried(tmp_path):
    config = tiny_kimi()
    weights = random_weights(config, seed=1)
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_hf_checkpoint(tmp_path, config, weights)
    with pytest.raises(MissingTensorError) as err:
        load_stage_model(tmp_path, LayerRange(0, 2))
    assert "model.layers.0.mlp.up_proj.weight" in str(err.value)
    assert "model.layers.0.block_sparse_moe.up_proj.weight" in str(err.value)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_canonical_name_is_tried_first_and_aliases_are_distinct(family):
    config = FAMILIES[family]()
    for name in weight_names(config):
        tried = candidates(name, config)
        assert tried[0].name == name and not tried[0].part
        assert len({repr(s) for s in tried}) == len(tried)
