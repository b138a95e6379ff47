"""Load and save Hugging Face checkpoint directories (config.json + safetensors, sharded too).

A stage reads only its slice's tensors: with a sharded checkpoint
(``model.safetensors.index.json``) only the shards holding them are opened, and safetensors
memory-maps each file, so a stage of a large model never pages in the other stages' weights.
Each tensor is found under any naming transformers writes or reads (``checkpoint_names``),
and block-wise FP8 weights are dequantised to the serving dtype as they are read
(``quantization``). Every failure is a typed ModelLoadError naming the file, tensor or
option that is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from prefill_node.errors import (
    InvalidModelConfigError,
    MissingTensorError,
    ModelFileNotFoundError,
    UnsupportedQuantizationError,
)
from prefill_node.model.checkpoint_names import resolve
from prefill_node.model.config import ModelConfig
from prefill_node.model.partition import LayerRange
from prefill_node.model.quantization import SCALE_SUFFIX, SUPPORTED, Fp8BlockQuantization
from prefill_node.model.stage_model import StageModel
from prefill_node.model.weights import EMBED, LM_HEAD, weight_names

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


class _Checkpoint:
    """The tensors of a checkpoint directory: which file holds each name (from the index of
    a sharded checkpoint, else the single file's header), with each file opened once, when
    first read, and closed with this object."""

    def __init__(self, p: Path, stack: ExitStack) -> None:
        self._dir, self._stack = p, stack
        self._open: dict[Path, tuple[Any, set[str]]] = {}
        index_path = p / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise InvalidModelConfigError(f"{index_path} is malformed: {e}") from e
            self.where = str(index_path)
            self._file = {name: p / file for name, file in weight_map.items()}
            return
        single = p / SINGLE_FILE
        if not single.is_file():
            raise ModelFileNotFoundError(f"{p} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self.where = str(single)
        self._file = dict.fromkeys(self._handle(single)[1], single)

    @property
    def names(self) -> Mapping[str, Path]:
        return self._file

    def _handle(self, file: Path) -> tuple[Any, set[str]]:
        """The open file and the names it holds."""
        if file not in self._open:
            if not file.is_file():
                raise ModelFileNotFoundError(f"checkpoint shard {file} does not exist")
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            self._open[file] = (handle, set(handle.keys()))
        return self._open[file]

    def raw(self, name: str) -> torch.Tensor:
        handle, held = self._handle(self._file[name])
        if name not in held:
            raise MissingTensorError(f"tensor {name!r} is missing from {self._file[name]}")
        return handle.get_tensor(name)

    def read(
        self, name: str, quantization: Fp8BlockQuantization | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """Tensor ``name`` as ``dtype``: dequantised when the checkpoint stores its scale next
        to it; a scale the config does not declare, or a low-precision tensor without its
        scale, raises UnsupportedQuantizationError instead of loading something wrong."""
        t = self.raw(name)
        scale_name = name + SCALE_SUFFIX
        if scale_name in self._file:
            if quantization is None:
                raise UnsupportedQuantizationError(
                    f"{self.where} holds {scale_name}, but config.json has no "
                    f"quantization_config; supported: {SUPPORTED}"
                )
            return quantization.dequantize(name, t, self.raw(scale_name), dtype)
        if not t.dtype.is_floating_point or t.element_size() == 1:
            raise UnsupportedQuantizationError(
                f"tensor {name!r} is stored as {t.dtype} with no {scale_name} next to it; "
                f"supported: {SUPPORTED}"
            )
        return t.to(dtype)


def load_hf_weights(
    path: str | Path,
    layer_range: LayerRange,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The tensors a stage holding ``layer_range`` needs, as ``dtype`` on the CPU, under our
    names (``weights.py``), wherever the checkpoint stores them (``checkpoint_names``), FP8
    weights dequantised one tensor at a time (``quantization``)."""
    p = _dir(path)
    with ExitStack() as stack:
        checkpoint = _Checkpoint(p, stack)
        out: dict[str, torch.Tensor] = {}
        fused: dict[str, torch.Tensor] = {}  # a fused tensor, read once for all its parts
        for name in weight_names(config, layer_range):
            source = resolve(name, config, checkpoint.names, checkpoint.where)
            if not source.part:
                out[name] = checkpoint.read(source.name, config.quantization, dtype)
                continue
            if source.name not in fused:
                fused[source.name] = checkpoint.read(source.name, config.quantization, dtype)
            out[name] = fused[source.name][source.part].contiguous()
        head_here = layer_range.is_last(config.num_layers) and LM_HEAD in checkpoint.names
        if config.tie_word_embeddings and head_here:
            _check_tied_head(checkpoint.read(LM_HEAD, config.quantization, dtype), out[EMBED])
        return out


def _check_tied_head(stored_head: torch.Tensor, embed: torch.Tensor) -> None:
    """With tied embeddings the LM head is the embedding matrix. A checkpoint that stores
    another head besides is ambiguous (transformers 5 then serves the stored head, earlier
    versions the tied one): refused rather than guessed."""
    if not torch.equal(stored_head, embed):
        raise InvalidModelConfigError(
            "config.json sets tie_word_embeddings=true, but the checkpoint stores an "
            f"{LM_HEAD} that differs from {EMBED}: set tie_word_embeddings to false to serve "
            f"the stored head, or remove {LM_HEAD} to tie it"
        )


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
