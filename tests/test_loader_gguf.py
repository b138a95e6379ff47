"""GGUF loader: tiny GGUF files written with the `gguf` package's own writer, read back."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from prefill_node.errors import (
    ModelFileNotFoundError,
    ModelLoadError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from prefill_node.model.config import ModelConfig, ModelFamily
from prefill_node.model.gguf_tokenizer import (
    build_tokenizer,
    read_tokenizer_spec,
    write_tokenizer_files,
)
from prefill_node.model.loader_gguf import load_gguf, open_gguf
from prefill_node.model.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from prefill_node.model.weights import random_weights

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_config(family: str = "llama", tie: bool = True) -> ModelConfig:
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    return ModelConfig.from_hf_config(
        {
            "architectures": [arch],
            "vocab_size": 40,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 128,
            "tie_word_embeddings": tie,
        },
        name="tiny",
    )


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows (the inverse of our load)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def write_gguf(
    path: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    arch: str | None = None,
    quant: dict[str, gguf.GGMLQuantizationType] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> None:
    arch = arch or config.family.value
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_vocab_size(config.vocab_size)
    quant = quant or {}
    for hf, tensor in weights.items():
        array = tensor.numpy().astype(np.float32)
        if config.family is ModelFamily.LLAMA and hf.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_heads)
        elif config.family is ModelFamily.LLAMA and hf.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_kv_heads)
        qtype = quant.get(hf)
        if qtype is None:
            w.add_tensor(gguf_name(hf), array)
        else:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name, raw in (extra_tensors or {}).items():
        w.add_tensor(name, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_f32_gguf_reads_back_exact_hf_weights_and_config(tmp_path: Path, family: str) -> None:
    config = tiny_config(family)
    weights = random_weights(config, seed=1)
    write_gguf(tmp_path / "m.gguf", config, weights)
    model = load_gguf(tmp_path / "m.gguf", name="tiny")
    assert model.config == config
    assert set(model.weights) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(model.weights[name], tensor), name  # q/k permutation undone


def test_untied_lm_head_and_quantised_tensors(tmp_path: Path) -> None:
    config = tiny_config(tie=False)
    weights = random_weights(config, seed=2)
    q8 = gguf.GGMLQuantizationType.Q8_0
    f16 = gguf.GGMLQuantizationType.F16
    quant = {"model.layers.0.self_attn.q_proj.weight": q8, "lm_head.weight": f16}
    write_gguf(tmp_path / "m.gguf", config, weights, quant=quant)
    model = load_gguf(tmp_path / "m.gguf", name="tiny")
    assert not model.config.tie_word_embeddings
    head = model.weights["lm_head.weight"]
    assert torch.equal(head, weights["lm_head.weight"].half().float())
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    expected = gguf.quants.dequantize(
        gguf.quants.quantize(llama_cpp_permute(q.numpy(), config.num_heads), q8), q8
    )
    got = model.weights["model.layers.0.self_attn.q_proj.weight"]
    order = llama_cpp_permute(np.arange(config.q_size), config.num_heads)  # gguf row -> hf row
    assert torch.equal(got, torch.from_numpy(expected[np.argsort(order)]))
    assert 0 < (got - q).abs().max() < 0.02  # really quantised, and close


def test_missing_file_is_typed(tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf_file_is_typed(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_gguf(tmp_path / "junk.gguf")


def test_unsupported_architecture_is_typed(tmp_path: Path) -> None:
    config = tiny_config()
    write_gguf(tmp_path / "m.gguf", config, random_weights(config, 3), arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'"):
        load_gguf(tmp_path / "m.gguf")


def test_llama3_rope_freqs_tensor_is_rejected(tmp_path: Path) -> None:
    config = tiny_config()
    extra = {"rope_freqs.weight": np.ones(config.head_dim // 2, dtype=np.float32)}
    write_gguf(tmp_path / "m.gguf", config, random_weights(config, 3), extra_tensors=extra)
    with pytest.raises(UnsupportedArchitectureError, match="rope_freqs"):
        load_gguf(tmp_path / "m.gguf")


def test_unknown_tensor_is_typed(tmp_path: Path) -> None:
    config = tiny_config()
    extra = {"blk.0.attn_q.bias": np.zeros(config.q_size, dtype=np.float32)}
    write_gguf(tmp_path / "m.gguf", config, random_weights(config, 3), extra_tensors=extra)
    with pytest.raises(UnsupportedArchitectureError, match=r"blk\.0\.attn_q\.bias"):
        load_gguf(tmp_path / "m.gguf")


def test_unsupported_quantisation_names_tensor_and_type(tmp_path: Path) -> None:
    config = tiny_config()
    weights = random_weights(config, 4)
    write_gguf(tmp_path / "m.gguf", config, weights)
    # Rewrite with one tensor stored as Q8_K (the gguf package cannot dequantise it).
    w = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    reader = open_gguf(tmp_path / "m.gguf")
    for key, field in reader.fields.items():
        if key.startswith("llama."):
            w.add_key_value(key, field.contents(), field.types[0])
    q8k = gguf.GGMLQuantizationType.Q8_K
    _, type_size = gguf.GGML_QUANT_SIZES[q8k]
    for t in reader.tensors:
        if t.name == "blk.1.ffn_up.weight":
            rows = config.intermediate_size
            raw = np.zeros((rows, type_size), dtype=np.uint8)  # one 256-wide block per row
            w.add_tensor(t.name, raw, raw_dtype=q8k)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedQuantizationError, match=r"blk\.1\.ffn_up\.weight.*Q8_K"):
        load_gguf(tmp_path / "k.gguf")


def test_tokenizer_spec_builds_byte_level_bpe(tmp_path: Path) -> None:
    config = tiny_config()
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    tokens = ["<|endoftext|>", "<|im_end|>", "a", "b", "c", "Ġ", "1", "2", "ab", "Ġab", "<think>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 4])
    w.add_token_merges(["a b", "Ġ ab"])
    w.add_eos_token_id(1)
    w.add_chat_template("{{ messages[0]['content'] }}")
    w.add_tensor("token_embd.weight", np.zeros((4, config.hidden_size), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    spec = read_tokenizer_spec(open_gguf(tmp_path / "t.gguf"))
    assert spec.eos_token_ids == (1,) and spec.pre == "smollm"
    tok = build_tokenizer(spec)
    # "12" splits per digit (smollm), " ab" merges, specials and user tokens stay whole.
    assert tok.encode("ab ab12<|im_end|><think>c").ids == [8, 9, 6, 7, 1, 10, 4]
    assert tok.decode([8, 9, 6, 7]) == "ab ab12"
    spec_sp = type(spec)(**{**spec.__dict__, "model": "llama"})
    with pytest.raises(UnsupportedArchitectureError, match="'llama'"):
        build_tokenizer(spec_sp)

    out = tmp_path / "tok"
    out.mkdir()
    write_tokenizer_files(spec, out, model_max_length=128)
    wrapped = Tokenizer.from_dir(out)
    assert wrapped.encode("ab ab12") == [8, 9, 6, 7] and wrapped.eos_token_ids == (1,)
    assert wrapped.apply_chat_template([{"role": "user", "content": "ab"}]) == "ab"
    assert wrapped.encode_chat([ChatMessage("user", "c<|im_end|>")]) == [4, 1]
    with pytest.raises(ChatTemplateError, match="failed to render"):
        wrapped.apply_chat_template([])  # the template indexes messages[0]
    with pytest.raises(ModelFileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
