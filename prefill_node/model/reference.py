"""Single-process reference forward: the whole model, one sequence, contiguous KV, no paging.

Written plainly and independently of the paged path (unfused HF-named weights, repeated KV
heads, an explicit softmax) so tests can check the pipeline, paging, chunking and reuse
against it. It is itself checked against transformers in tests/test_model_hf_parity.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from prefill_node.errors import MissingTensorError
from prefill_node.model.config import ModelConfig
from prefill_node.model.rope import inverse_frequencies
from prefill_node.model.weights import EMBED, FINAL_NORM, LM_HEAD, weight_names


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def reference_forward(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], token_ids: Sequence[int]
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run all layers over ``token_ids`` (positions 0..T-1) in the weights' dtype and device.

    Returns the fp32 logits of the last token [vocab] and, per layer, the post-RoPE (and, for
    Qwen3, post-q/k-norm) K and V [T, kv_heads, head_dim] - what a paged cache must hold.
    """
    for name in weight_names(config):
        if name not in weights:
            raise MissingTensorError(f"tensor {name!r} is missing from the reference weights")
    embed = weights[EMBED]
    device, dtype = embed.device, embed.dtype
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    n, hd = ids.shape[0], config.head_dim
    eps = config.rms_norm_eps

    inv_freq = inverse_frequencies(hd, config.rope_theta, config.rope_scaling).to(device)
    freqs = torch.arange(n, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    group = config.num_heads // config.num_kv_heads

    x = embed[ids]
    kv_per_layer = []
    for layer in range(config.num_layers):

        def w(suffix: str, _layer: int = layer) -> torch.Tensor:
            return weights[f"model.layers.{_layer}.{suffix}"]

        h = _norm(x, w("input_layernorm.weight"), eps)
        q = (h @ w("self_attn.q_proj.weight").T).view(n, config.num_heads, hd)
        k = (h @ w("self_attn.k_proj.weight").T).view(n, config.num_kv_heads, hd)
        v = (h @ w("self_attn.v_proj.weight").T).view(n, config.num_kv_heads, hd)
        if config.qk_norm:
            q = _norm(q, w("self_attn.q_norm.weight"), eps)
            k = _norm(k, w("self_attn.k_norm.weight"), eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        kv_per_layer.append((k.clone(), v.clone()))
        kr = k.repeat_interleave(group, dim=1)
        vr = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), kr.float()) / hd**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, vr.float()).to(dtype).reshape(n, -1)
        x = x + attn @ w("self_attn.o_proj.weight").T
        h = _norm(x, w("post_attention_layernorm.weight"), eps)
        gate = torch.nn.functional.silu(h @ w("mlp.gate_proj.weight").T)
        x = x + (gate * (h @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T

    head = weights[EMBED] if config.tie_word_embeddings else weights[LM_HEAD]
    last = _norm(x[-1:], weights[FINAL_NORM], eps)
    return (last @ head.T).float()[0], kv_per_layer
