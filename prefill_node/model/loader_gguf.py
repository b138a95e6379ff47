"""Read a GGUF file (llama.cpp format) into Hugging Face-named fp32 tensors and a ModelConfig.

Supported: architectures ``llama`` and ``qwen3`` (dense, no Llama-3 ``rope_freqs``), every tensor
type the ``gguf`` package can dequantise (F32/F16/BF16, Q4_0..Q8_0, the K-quants, IQ types).
llama.cpp's converter permutes the rows of Llama's q/k projections (interleaved rotary halves);
``load_gguf`` undoes that, so the tensors match the original Hugging Face checkpoint layout.
Qwen3 is converted without that permutation, so its q/k are taken as they are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefill_node.errors import (
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from prefill_node.model.config import ModelConfig
from prefill_node.model.gguf_tokenizer import GGUFTokenizerSpec, read_tokenizer_spec

SUPPORTED_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF per-layer tensor name -> Hugging Face name (after "model.layers.{i}.").
_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFModel:
    """A whole model read from one GGUF file: config, HF-named fp32 weights, tokenizer spec."""

    path: Path
    config: ModelConfig
    hf_config: dict[str, Any]  # what config.json should hold (transformers-loadable)
    weights: dict[str, torch.Tensor]
    tokenizer: GGUFTokenizerSpec


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped); typed error when it is not a GGUF."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelFileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """The decoded value of metadata ``key`` (str, int, float, bool or list), or ``default``."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_hf_config(reader: Any, name: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict equivalent to the GGUF metadata of ``reader``."""
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedArchitectureError(
            "GGUF carries a 'rope_freqs' tensor (Llama-3 rope scaling baked into frequencies); "
            "convert from the Hugging Face checkpoint instead"
        )

    def req(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks '{arch}.{key}'")
        return value

    hidden = int(req("embedding_length"))
    num_heads = int(req("attention.head_count"))
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(field_value(reader, "tokenizer.ggml.tokens", []))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(
            field_value(reader, f"{arch}.attention.head_count_kv", num_heads)
        ),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(req("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(req("context_length")),
        "tie_word_embeddings": not has_output,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "_name_or_path": name,
    }


def _f32(value: float) -> float:
    """A GGUF float32 as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of GGUF tensor ``gguf_name``; typed error for unknown tensors."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise UnsupportedArchitectureError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent")


def reverse_llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head: interleaved pairs -> rotary halves).

    llama.cpp stores rows of head h as (dim/2, 2) interleaved; Hugging Face as (2, dim/2).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


@functools.cache
def can_dequantize(qtype: Any) -> bool:
    """Whether the installed ``gguf`` package dequantises tensor type ``qtype`` (probes 1 block)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return block_size > 0


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """fp32 array of one GGUF tensor in row-major (PyTorch) shape."""
    from gguf.quants import dequantize

    if not can_dequantize(tensor.tensor_type):
        raise UnsupportedQuantizationError(
            f"GGUF tensor {tensor.name!r} uses quantisation type {tensor.tensor_type.name}, "
            "which the installed gguf package cannot dequantise"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    array = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    # F32/F16 tensors come back as read-only views of the memory map: copy them.
    return np.require(array, np.float32, ("C", "W", "O")).reshape(shape)


def load_gguf(path: str | Path, name: str | None = None) -> GGUFModel:
    """Read the whole model in ``path`` as fp32 tensors with Hugging Face names.

    Validates architecture and every tensor's type before dequantising anything, so a bad
    file fails fast with UnsupportedArchitectureError / UnsupportedQuantizationError.
    """
    reader = open_gguf(path)
    path = Path(path)
    name = name or str(field_value(reader, "general.name", path.stem))
    hf_config = gguf_hf_config(reader, name)
    for tensor in reader.tensors:
        hf_tensor_name(tensor.name)
        if not can_dequantize(tensor.tensor_type):
            dequantize_tensor(tensor)  # raises the typed error naming the tensor
    permute = hf_config["model_type"] == "llama"
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config["num_key_value_heads"]
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = dequantize_tensor(tensor)
        if permute and tensor.name.endswith(".attn_q.weight"):
            array = reverse_llama_permute(array, heads)
        elif permute and tensor.name.endswith(".attn_k.weight"):
            array = reverse_llama_permute(array, kv_heads)
        weights[hf_tensor_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(array))
    config = ModelConfig.from_hf_config(hf_config, name)
    return GGUFModel(path, config, hf_config, weights, read_tokenizer_spec(reader))
