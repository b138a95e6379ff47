"""Hugging Face checkpoint loading and saving: round trips, transformers interop, typed errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from prefill_node.errors import (
    InvalidModelConfigError,
    MissingTensorError,
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig, ModelFamily, MoeConfig, QkNorm, RopeScaling
from prefill_node.model.loader_hf import (
    load_hf_config,
    load_hf_weights,
    load_stage_model,
    save_hf_checkpoint,
)
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.reference import reference_forward
from prefill_node.model.weights import random_weights, weight_names

CONFIG = ModelConfig(
    family=ModelFamily.LLAMA,
    vocab_size=53,
    hidden_size=32,
    intermediate_size=40,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32),
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_ids=(2, 3),
    name="ckpt",
)
TOKENS = [1, 7, 9, 30, 4, 4, 52, 11, 0, 17, 23]


def pipeline_logits(path, num_stages: int) -> torch.Tensor:
    table = (3, 0, 2)
    batch = ChunkBatch((ChunkSpec(0, len(TOKENS), table),))
    x = torch.tensor(TOKENS)
    for lr in split_layers(CONFIG.num_layers, num_stages):
        stage = load_stage_model(path, lr)
        x = stage(x, batch, PagedKVCache.for_model(stage.config, lr, 4, 4))
    return stage.compute_logits(x[-1:])[0]


@pytest.mark.parametrize("shard_max_bytes", [None, 6000])
def test_checkpoint_round_trip(tmp_path, shard_max_bytes):
    weights = random_weights(CONFIG, seed=1)
    save_hf_checkpoint(tmp_path, CONFIG, weights, shard_max_bytes=shard_max_bytes)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if shard_max_bytes is None:
        assert shards == ["model.safetensors"]
    else:
        assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    config = load_hf_config(tmp_path, name="ckpt")
    assert config == CONFIG
    mid = LayerRange(1, 3)
    sliced = load_hf_weights(tmp_path, mid, config)
    assert sorted(sliced) == sorted(weight_names(CONFIG, mid))
    assert all(torch.equal(sliced[n], weights[n]) for n in sliced)
    expected, _ = reference_forward(CONFIG, weights, TOKENS)
    for stages in (1, 3):
        torch.testing.assert_close(pipeline_logits(tmp_path, stages), expected, atol=1e-4, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([TOKENS])).logits[0, -1]
    torch.testing.assert_close(hf_logits, expected, atol=1e-4, rtol=0)


def test_loads_checkpoint_saved_by_transformers(tmp_path):
    """A sharded Qwen3 checkpoint written by transformers itself (tied, bf16 on disk)."""
    config = replace(CONFIG, family=ModelFamily.QWEN3, rope_scaling=None, tie_word_embeddings=True)
    hf_cfg = transformers.AutoConfig.for_model(**config.to_hf_config())
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    hf.load_state_dict(random_weights(config, seed=2), strict=False)
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_hf_config(tmp_path)
    assert replace(loaded, name="") == replace(config, name="")
    # reload rather than hf.float(): casting to bf16 and back also rounds RoPE's inv_freq buffer
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([TOKENS])).logits[0, -1]
    stage = load_stage_model(tmp_path, LayerRange(0, 4))
    kv = PagedKVCache.for_model(loaded, stage.layer_range, 3, 4)
    hidden = stage(torch.tensor(TOKENS), ChunkBatch((ChunkSpec(0, 11, (1, 2, 0)),)), kv)
    torch.testing.assert_close(stage.compute_logits(hidden[-1:])[0], expected, atol=1e-4, rtol=0)


def test_parses_transformers_5_rope_parameters():
    hf_dict = transformers.AutoConfig.for_model(**CONFIG.to_hf_config()).to_dict()
    assert "rope_parameters" in hf_dict
    hf_dict.pop("rope_scaling", None)
    hf_dict.pop("rope_theta", None)
    assert ModelConfig.from_hf_config(hf_dict, name="ckpt") == CONFIG


def write_config(path, **changes):
    d = CONFIG.to_hf_config()
    d.update(changes)
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (
            {"architectures": ["MistralForCausalLM"]},
            UnsupportedArchitectureError,
            "MistralForCausalLM",
        ),
        ({"architectures": [], "model_type": "gpt2"}, UnsupportedArchitectureError, "gpt2"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            UnsupportedArchitectureError,
            "yarn",
        ),
        ({"attention_bias": True}, UnsupportedArchitectureError, "attention_bias"),
        ({"hidden_act": "gelu"}, UnsupportedArchitectureError, "gelu"),
        ({"num_key_value_heads": 3}, InvalidModelConfigError, "multiple of num_kv_heads"),
        ({"hidden_size": None}, InvalidModelConfigError, "malformed"),
        ({"vocab_size": -1}, InvalidModelConfigError, "vocab_size"),
    ],
)
def test_bad_config_raises_typed_error(tmp_path, changes, error, match):
    write_config(tmp_path, **changes)
    with pytest.raises(error, match=match):
        load_hf_config(tmp_path)


def test_missing_files_and_tensors_raise_typed_errors(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(ModelFileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidModelConfigError, match="not valid JSON"):
        load_hf_config(tmp_path)
    d = CONFIG.to_hf_config()
    del d["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(InvalidModelConfigError, match="num_hidden_layers"):
        load_hf_config(tmp_path)
    write_config(tmp_path)
    with pytest.raises(ModelFileNotFoundError, match="model.safetensors"):
        load_stage_model(tmp_path, LayerRange(0, 4))

    weights = random_weights(CONFIG, seed=1)
    save_hf_checkpoint(tmp_path, CONFIG, weights)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    load_stage_model(tmp_path, LayerRange(0, 2))  # the slice without layer 2 still loads
    with pytest.raises(MissingTensorError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_stage_model(tmp_path, LayerRange(2, 4))
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(InvalidModelConfigError, match="shape"):
        load_stage_model(tmp_path, LayerRange(2, 4))


def test_sharded_checkpoint_missing_shard(tmp_path):
    save_hf_checkpoint(tmp_path, CONFIG, random_weights(CONFIG, seed=1), shard_max_bytes=6000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    last_shard = index["weight_map"]["lm_head.weight"]
    (tmp_path / last_shard).unlink()
    load_stage_model(tmp_path, LayerRange(0, 1))
    with pytest.raises(ModelFileNotFoundError, match=last_shard):
        load_stage_model(tmp_path, LayerRange(3, 4))
    assert issubclass(ModelFileNotFoundError, ModelLoadError)


# GLM-5, Qwen3-Next and Kimi Linear need MLA / recurrent settings: round trips in own tests
OWN_TESTS = (ModelFamily.GLM_MOE_DSA, ModelFamily.QWEN3_NEXT, ModelFamily.KIMI_LINEAR)


@pytest.mark.parametrize("family", [f for f in ModelFamily if f not in OWN_TESTS])
def test_config_round_trips_through_hf_dict(family):
    moe = MoeConfig(4, 2, 40) if family is ModelFamily.MINIMAX_M2 else None
    config = replace(CONFIG, family=family, rope_scaling=None, eos_token_ids=(2,), moe=moe)
    assert ModelConfig.from_hf_config(config.to_hf_config(), name="ckpt") == config
    expected_norm = {ModelFamily.QWEN3: QkNorm.PER_HEAD, ModelFamily.MINIMAX_M2: QkNorm.PER_LAYER}
    assert config.qk_norm is expected_norm.get(family, QkNorm.NONE)
    # 2 (K and V) x 3 layers x 2 kv heads x 8 dims x 2 bytes
    assert config.kv_bytes_per_token(3, torch.bfloat16) == 2 * 3 * 2 * 8 * 2
