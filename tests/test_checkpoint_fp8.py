"""Block-wise FP8 checkpoints (the official FP8 releases' layout) load as transformers' own
dequantising load of the same directory, through the stage loader and `wavepp prefill`; every
other quantisation, and an FP8 tensor without its scale, is refused with a typed error."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from prefill_node.errors import InvalidModelConfigError, UnsupportedQuantizationError
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig
from prefill_node.model.loader_hf import (
    load_hf_config,
    load_hf_weights,
    load_stage_model,
    save_hf_checkpoint,
)
from prefill_node.model.paged_kv import PagedKVCache
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.model.quantization import Fp8BlockQuantization
from prefill_node.model.weights import random_weights
from tests.test_cli_prefill import wavepp
from tests.tiny_models import tiny_minimax_m2, tiny_qwen3

TOKENS = [1, 7, 9, 30, 4, 4, 52, 11, 0, 17, 23, 5, 40]
# Linear layers inside decoder layers are quantised; embeddings, norms, MoE routers (and their
# bias) and the LM head stay in full precision, as in the releases (MiniMax-M2 lists them in
# modules_to_not_convert).
QUANTISED = re.compile(r"model\.layers\.\d+\..*(_proj|\.w[123])\.weight")
RELEASE_SKIP = ["gate", "e_score_correction_bias", "lm_head"]
FAMILIES = {"qwen3": lambda: tiny_qwen3("fp8-qwen3", 128), "minimax_m2": tiny_minimax_m2}


def fp8_quantise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as float8_e4m3fn values and one float32 multiplier per block (the last block of
    a row or column may be partial), each block scaled so its largest value maps to 448."""
    rows, cols = w.shape
    br, bc = block
    scale = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            s = part.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (part / s).to(torch.float8_e4m3fn)
    return q, scale


def elementwise_dequantise(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """Every element times the scale of the block it lies in (an independent reference)."""
    rows = torch.arange(q.shape[0]) // block[0]
    cols = torch.arange(q.shape[1]) // block[1]
    return q.float() * scale[rows][:, cols]


def write_fp8_checkpoint(path: Path, config: ModelConfig, block, seed: int = 3):
    """A checkpoint in the releases' FP8 layout; returns the weights it really holds (the
    FP8 values dequantised element by element)."""
    quant = Fp8BlockQuantization(*block, tuple(RELEASE_SKIP))
    weights = random_weights(config, seed=seed)
    stored: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if QUANTISED.fullmatch(name):
            q, scale = fp8_quantise(w, block)
            stored[name], stored[name + "_scale_inv"] = q, scale
            exact[name] = elementwise_dequantise(q, scale, block)
        else:
            stored[name] = exact[name] = w
    path.mkdir(parents=True, exist_ok=True)
    hf = {**config.to_hf_config(), "quantization_config": quant.to_hf(), "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(hf))
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    return exact


def pipeline_logits(path: Path, num_stages: int) -> torch.Tensor:
    config = load_hf_config(path)
    batch = ChunkBatch((ChunkSpec(0, len(TOKENS), (0, 1, 2, 3)),))
    x = torch.tensor(TOKENS)
    for lr in split_layers(config.num_layers, num_stages):
        stage = load_stage_model(path, lr)
        x = stage(x, batch, PagedKVCache.for_model(stage.config, lr, 4, 4))
    return stage.compute_logits(x)


def transformers_logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("block", [(128, 128), (8, 8)], ids=["release-128", "8x8"])
def test_fp8_checkpoint_matches_transformers_dequantising_load(tmp_path, family, block):
    config = FAMILIES[family]()
    exact = write_fp8_checkpoint(tmp_path, config, block)
    ours = pipeline_logits(tmp_path, 2)
    theirs = transformers_logits(tmp_path)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    # the same weights as a plain checkpoint: the dequantised load is exactly those weights
    plain = tmp_path / "plain"
    save_hf_checkpoint(plain, config, exact)
    assert torch.allclose(pipeline_logits(plain, 1), ours, atol=1e-4)
    # reading the FP8 values without their scales (what a dtype cast does) answers otherwise
    assert not torch.allclose(pipeline_logits(plain, 1), _unscaled_logits(tmp_path), atol=1e-2)


def _unscaled_logits(path: Path) -> torch.Tensor:
    tensors = load_file(str(path / "model.safetensors"))
    cast = {n: t.float() for n, t in tensors.items() if not n.endswith("_scale_inv")}
    unscaled = path / "unscaled"
    save_hf_checkpoint(unscaled, replace(load_hf_config(path), quantization=None), cast)
    return pipeline_logits(unscaled, 1)


def test_partial_blocks_and_scales_in_another_shard(tmp_path):
    """Expert weights of 24 rows in 16-row blocks: the last block row is partial. The index
    puts every scale in a shard of its own, and a stage reads only its layers."""
    config = tiny_minimax_m2()
    block = (16, 16)
    exact = write_fp8_checkpoint(tmp_path, config, block)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    rest = {n: t for n, t in tensors.items() if n not in scales}
    save_file(rest, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(scales, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in rest}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in scales})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_hf_weights(tmp_path, LayerRange(2, 4), load_hf_config(tmp_path))
    assert "model.layers.2.block_sparse_moe.experts.5.w1.weight" in loaded
    assert not any(n.startswith("model.layers.1.") for n in loaded)
    for name, t in loaded.items():
        assert torch.equal(t, exact[name]), name


@pytest.mark.parametrize(
    ("quantization_config", "match"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [8, 8]},
            "activation_scheme 'static'",
        ),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ],
)
def test_other_quantisations_are_refused_naming_the_field(tmp_path, quantization_config, match):
    hf = {**tiny_qwen3("q", 128).to_hf_config(), "quantization_config": quantization_config}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedQuantizationError, match=match) as err:
        load_hf_config(tmp_path)
    assert "supported: quant_method fp8" in str(err.value)


def test_scales_without_config_and_fp8_without_scales_are_refused(tmp_path):
    config = tiny_qwen3("q", 128)
    write_fp8_checkpoint(tmp_path, config, (8, 8))
    hf = json.loads((tmp_path / "config.json").read_text())
    plain_hf = {k: v for k, v in hf.items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(plain_hf))
    with pytest.raises(UnsupportedQuantizationError, match="no quantization_config"):
        load_stage_model(tmp_path, LayerRange(0, 3))

    (tmp_path / "config.json").write_text(json.dumps(hf))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    load_stage_model(tmp_path, LayerRange(2, 3))  # a stage without layer 1 still loads
    with pytest.raises(UnsupportedQuantizationError, match=r"up_proj\.weight.*float8_e4m3fn"):
        load_stage_model(tmp_path, LayerRange(0, 2))

    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(5, 5)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidModelConfigError, match=r"scale_inv has shape \(5, 5\)"):
        load_stage_model(tmp_path, LayerRange(0, 2))


def test_config_round_trips_with_its_quantisation():
    hf = {
        **tiny_minimax_m2().to_hf_config(),
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "float8_e4m3fn",  # MiniMax-M2's spelling
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": RELEASE_SKIP,
        },
    }
    config = ModelConfig.from_hf_config(hf, name="m2")
    assert config.quantization == Fp8BlockQuantization(128, 128, tuple(RELEASE_SKIP))
    assert ModelConfig.from_hf_config(config.to_hf_config(), name="m2") == config


@pytest.mark.slow
def test_wavepp_prefill_on_an_fp8_checkpoint_answers_as_transformers(tmp_path):
    """The reported failure: `wavepp prefill --stages 2` on an FP8 Qwen3 served a wrong first
    token without a word. Through the real 2-process pipeline it now equals transformers."""
    write_fp8_checkpoint(tmp_path, FAMILIES["qwen3"](), (8, 8))
    ids = ",".join(map(str, TOKENS))
    out = wavepp("--model", str(tmp_path), "--stages", "2", "--ids", ids, "--no-chat", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])
    expected = torch.log_softmax(transformers_logits(tmp_path)[-1], dim=-1)
    assert row["first_token_id"] == int(expected.argmax())
    for token_id, logprob in row["top_logprobs"]:
        assert abs(logprob - float(expected[token_id])) < 1e-4

    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    out = wavepp("--model", str(tmp_path), "--stages", "2", "--ids", ids, "--no-chat")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "wavepp prefill: UnsupportedQuantizationError: quantization_config.quant_method 'awq' "
        "is not supported; supported: quant_method fp8 with fmt e4m3, weight_block_size "
        "[rows, cols] and activation_scheme dynamic (block-wise FP8 as in the official FP8 "
        "releases), or an unquantised checkpoint"
    ]
