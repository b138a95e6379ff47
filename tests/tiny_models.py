"""Tiny random-init model configs shared by the tests (one place to change their shape)."""

from __future__ import annotations

from typing import Any

from prefill_node.model.config import ModelConfig

# A 4-layer GQA Llama small enough for multi-process and NIXL tests to start in seconds.
TINY_LLAMA_HF: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def tiny_llama_hf(**overrides: Any) -> dict[str, Any]:
    """``TINY_LLAMA_HF`` with HF config keys replaced, e.g. ``tie_word_embeddings=False``."""
    return {**TINY_LLAMA_HF, **overrides}


def tiny_llama(name: str = "tiny-llama", **overrides: Any) -> ModelConfig:
    """The tiny Llama as a ModelConfig (``name`` is the model identity in block hashes)."""
    return ModelConfig.from_hf_config(tiny_llama_hf(**overrides), name=name)


def tiny_qwen3(name: str, max_position_embeddings: int, vocab_size: int = 61) -> ModelConfig:
    """A 3-layer GQA Qwen3 (q/k norm, tied embeddings)."""
    from prefill_node.model.config import ModelFamily

    return ModelConfig(
        family=ModelFamily.QWEN3,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        name=name,
    )


# A 4-layer MiniMax-M2 (sigmoid-routed MoE, 8 experts / 2 per token, partial RoPE, q/k norm
# over the whole projection), untied: same attention shape as the tiny Llama.
TINY_MINIMAX_M2_HF: dict[str, Any] = {
    **TINY_LLAMA_HF,
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "intermediate_size": 24,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rotary_dim": 4,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "tie_word_embeddings": False,
}


def tiny_minimax_m2(name: str = "tiny-minimax-m2", **overrides: Any) -> ModelConfig:
    """The tiny MiniMax-M2 as a ModelConfig."""
    return ModelConfig.from_hf_config({**TINY_MINIMAX_M2_HF, **overrides}, name=name)


# A 3-layer GLM-5 (glm_moe_dsa): MLA (q LoRA 24, KV latent 16, rope 8, nope 12, v 12), a DSA
# indexer keeping the 8 best earlier positions (16 heads of 16), 1 dense layer then a MoE of
# 8 experts in 2 groups (1 chosen), 2 per token, scaled by 2.5, plus a shared expert.
TINY_GLM5_HF: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 12,
    "v_head_dim": 12,
    "index_topk": 8,
    "index_head_dim": 16,
    "index_n_heads": 16,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def tiny_glm5(name: str = "tiny-glm5", **overrides: Any) -> ModelConfig:
    """The tiny GLM-5 as a ModelConfig."""
    return ModelConfig.from_hf_config({**TINY_GLM5_HF, **overrides}, name=name)


# A 4-layer Qwen3-Next: linear (GatedDeltaNet: 2 key heads of 8 shared by 4 value heads of 6,
# conv kernel 4), linear, gated full attention (4 heads of 8 over 2 KV heads, half of each
# head rotated), linear; a softmax-routed MoE of 8 experts (2 per token) plus a sigmoid-gated
# shared expert in every layer.
TINY_QWEN3_NEXT_HF: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def tiny_qwen3_next(name: str = "tiny-qwen3-next", **overrides: Any) -> ModelConfig:
    """The tiny Qwen3-Next as a ModelConfig."""
    return ModelConfig.from_hf_config({**TINY_QWEN3_NEXT_HF, **overrides}, name=name)


# A 4-layer Kimi Linear: KDA layers 0, 1 and 3 (4 heads of 8, conv width 4) and an MLA layer 2
# without q LoRA, indexer or RoPE (latent 16, "rope" part 8, nope 12, v 12); 1 dense layer,
# then a MoE of 8 experts in 2 groups (1 chosen), 2 per token, scaled by 2.5, plus a shared
# expert. Spelled as the released config.json spells it.
TINY_KIMI_HF: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "num_expert_group": 2,
    "topk_group": 1,
    "use_grouped_topk": True,
    "routed_scaling_factor": 2.5,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "mla_use_nope": True,
    "linear_attn_config": {
        "num_heads": 4,
        "head_dim": 8,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3],
    },
    "model_max_length": 256,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def tiny_kimi(name: str = "tiny-kimi", **overrides: Any) -> ModelConfig:
    """The tiny Kimi Linear as a ModelConfig."""
    return ModelConfig.from_hf_config({**TINY_KIMI_HF, **overrides}, name=name)


# A word-level tokenizer for the tiny models: text prompts and chat templates without a
# real vocabulary. Words beyond WORDS are "w14", "w15", ... up to ``vocab_size``.
WORDS = ("<unk>", "<|system|>", "<|user|>", "<|assistant|>", "be", "brief", "what", "is", "the",
         "capital", "of", "france", "spain", "?")  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_word_tokenizer(directory: Any, vocab_size: int = len(WORDS)) -> None:
    """tokenizer.json (word level: WORDS, then filler words up to ``vocab_size``, so every
    id decodes to a word) + tokenizer_config.json with CHAT_TEMPLATE."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer as Backend
    from tokenizers.decoders import WordPiece
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = [*WORDS, *(f"w{i}" for i in range(len(WORDS), vocab_size))]
    backend = Backend(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    backend.decoder = WordPiece(prefix="##")  # joins words with spaces
    backend.add_special_tokens(["<|system|>", "<|user|>", "<|assistant|>"])
    directory = Path(directory)
    backend.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
