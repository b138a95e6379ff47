"""Single-process reference forward: the whole model, one sequence, contiguous KV, no paging.

Written plainly and independently of the paged path (unfused HF-named weights, repeated KV
heads, an explicit softmax) so tests can check the pipeline, paging, chunking and reuse
against it. It is itself checked against transformers in tests/test_model_hf_parity.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from prefill_node.errors import MissingTensorError, UnsupportedArchitectureError
from prefill_node.model.config import ModelConfig, ModelFamily, MoeConfig, QkNorm
from prefill_node.model.rope import inverse_frequencies
from prefill_node.model.weights import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    MINIMAX_MOE,
    weight_names,
)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat((xr * cos + rotated * sin, rest), dim=-1)


def _swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T


def _moe(moe: MoeConfig, h: torch.Tensor, w) -> torch.Tensor:
    """Token by token, expert by expert: sigmoid scores, biased top-k choice, renormalised."""
    out = torch.zeros_like(h)
    n = MINIMAX_MOE
    scores = torch.sigmoid((h @ w(n.router).T).float())
    for t in range(h.shape[0]):
        chosen = torch.topk(scores[t] + w(n.bias).float(), moe.top_k).indices
        weights = scores[t, chosen] / scores[t, chosen].sum()
        for e, weight in zip(chosen.tolist(), weights, strict=True):
            proj = (
                n.expert_tensor(e, n.gate),
                n.expert_tensor(e, n.up),
                n.expert_tensor(e, n.down),
            )
            y = _swiglu(h[t : t + 1], *(w(s) for s in proj))
            out[t] += (y[0].float() * weight).to(h.dtype)
    return out


@torch.inference_mode()
def reference_forward(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], token_ids: Sequence[int]
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Run all layers over ``token_ids`` (positions 0..T-1) in the weights' dtype and device.

    Returns the fp32 logits of the last token [vocab] and, per layer, the post-RoPE (and, for
    Qwen3, post-q/k-norm) K and V [T, kv_heads, head_dim] - what a paged cache must hold.
    """
    if config.family not in (ModelFamily.LLAMA, ModelFamily.QWEN3, ModelFamily.MINIMAX_M2):
        raise UnsupportedArchitectureError(
            f"reference_forward implements Llama, Qwen3 and MiniMax-M2, not {config.family.value}"
            " (compare such models with transformers)"
        )
    for name in weight_names(config):
        if name not in weights:
            raise MissingTensorError(f"tensor {name!r} is missing from the reference weights")
    embed = weights[EMBED]
    device, dtype = embed.device, embed.dtype
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device)
    n, hd = ids.shape[0], config.head_dim
    eps = config.rms_norm_eps

    inv_freq = inverse_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling)
    inv_freq = inv_freq.to(device)
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
        q = h @ w("self_attn.q_proj.weight").T
        k = h @ w("self_attn.k_proj.weight").T
        v = (h @ w("self_attn.v_proj.weight").T).view(n, config.num_kv_heads, hd)
        if config.qk_norm is QkNorm.PER_LAYER:
            q = _norm(q, w("self_attn.q_norm.weight"), eps)
            k = _norm(k, w("self_attn.k_norm.weight"), eps)
        q, k = q.view(n, config.num_heads, hd), k.view(n, config.num_kv_heads, hd)
        if config.qk_norm is QkNorm.PER_HEAD:
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
        if config.moe is not None:
            x = x + _moe(config.moe, h, w)
        else:
            mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
            x = x + _swiglu(h, *(w(s) for s in mlp))

    head = weights[EMBED] if config.tie_word_embeddings else weights[LM_HEAD]
    last = _norm(x[-1:], weights[FINAL_NORM], eps)
    return (last @ head.T).float()[0], kv_per_layer
