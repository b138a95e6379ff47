"""Load and save Hugging Face checkpoint directories (config.json + safetensors, sharded too).

A stage reads only its slice's tensors: with a sharded checkpoint
(``model.safetensors.index.json``) only the shards holding them are opened, and safetensors
memory-maps each file, so a stage of a large model never pages in the other stages' weights.
Every failure is a typed ModelLoadError naming the file, tensor or option that is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefill_node.errors import InvalidModelConfigError, MissingTensorError, ModelFileNotFoundError
from prefill_node.model.config import ModelConfig
from prefill_node.model.partition import LayerRange
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import LM_HEAD, weight_names

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ModelFileNotFoundError(f"model directory {p} does not exist")
    return p


def load_hf_config(path: str | Path, name: str | None = None) -> ModelConfig:
    """Parse ``path/config.json``. ``name`` (the model identity in block hashes) defaults to
    config.json's ``_name_or_path``, else the directory's name: it must be the same on every
    pipeline serving this model (the router compares hashes across pipelines), so pass a
    stable, distinct one when directory names are not."""
    p = _dir(path)
    cfg_path = p / CONFIG_FILE
    if not cfg_path.is_file():
        raise ModelFileNotFoundError(f"{cfg_path} does not exist (not a Hugging Face checkpoint?)")
    try:
        d = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise InvalidModelConfigError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise InvalidModelConfigError(f"{cfg_path} must hold a JSON object")
    return ModelConfig.from_hf_config(
        d, name=name or str(d.get("_name_or_path") or p.resolve().name)
    )


def _tensor_files(p: Path, names: list[str]) -> dict[Path, list[str]]:
    """Which safetensors file holds each wanted tensor, grouped by file."""
    index_path = p / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InvalidModelConfigError(f"{index_path} is malformed: {e}") from e
        files: dict[Path, list[str]] = {}
        for name in names:
            if name not in weight_map:
                raise MissingTensorError(f"tensor {name!r} is not listed in {index_path}")
            files.setdefault(p / weight_map[name], []).append(name)
        return files
    single = p / SINGLE_FILE
    if not single.is_file():
        raise ModelFileNotFoundError(f"{p} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return {single: names}


def load_hf_weights(
    path: str | Path,
    layer_range: LayerRange,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The HF-named tensors a stage holding ``layer_range`` needs, as ``dtype`` on the CPU."""
    p = _dir(path)
    names = weight_names(config, layer_range)
    out: dict[str, torch.Tensor] = {}
    for file, wanted in _tensor_files(p, names).items():
        if not file.is_file():
            raise ModelFileNotFoundError(f"checkpoint shard {file} does not exist")
        with safe_open(str(file), framework="pt") as f:
            present = set(f.keys())
            for name in wanted:
                if name not in present:
                    raise MissingTensorError(f"tensor {name!r} is missing from {file}")
                out[name] = f.get_tensor(name).to(dtype)
    return out


def load_stage_model(
    path: str | Path,
    layer_range: LayerRange,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> StageModel:
    """Config + this slice's weights -> a ready StageModel on ``device``."""
    config = load_hf_config(path)
    model = StageModel(config, layer_range, dtype, device)
    model.load_weights(load_hf_weights(path, layer_range, config, dtype))
    return model


def save_hf_checkpoint(
    path: str | Path,
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor],
    shard_max_bytes: int | None = None,
) -> None:
    """Write ``config.json`` and the weights as ``model.safetensors``, or, when
    ``shard_max_bytes`` is given, as ``model-0000i-of-0000n.safetensors`` shards of at most
    that size (a single larger tensor gets its own shard) plus the index. With tied
    embeddings ``lm_head.weight`` is dropped, as transformers does. transformers can load
    the result with ``from_pretrained``."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to("cpu").contiguous().clone()
        for name, t in weights.items()
        if not (config.tie_word_embeddings and name == LM_HEAD)
    }
    hf = config.to_hf_config()
    hf["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (p / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    if shard_max_bytes is None:
        save_file(tensors, str(p / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(p / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (p / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
