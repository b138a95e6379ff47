"""Rotary position embedding with Hugging Face conventions (rotate_half, Llama-3 scaling).

Numerics follow transformers exactly: inverse frequencies and ``position * inv_freq`` in
fp32, cos/sin cast to the activation dtype, ``x * cos + rotate_half(x) * sin``. The
frequency vector ``[inv_freq, inv_freq]`` is laid out so that element i pairs with
element i + head_dim / 2 (not interleaved pairs, as in the Meta reference code).
"""

from __future__ import annotations

import math

import torch

from prefill_node.model.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 [head_dim / 2] inverse frequencies, with the configured scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for a model; ``cos_sin`` is computed once per forward and shared by
    all layers of the stage."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.inv_freq = inverse_frequencies(
            config.rotary_dim, config.rope_theta, config.rope_scaling
        ).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin [T, 1, rotary_dim] (broadcast over heads) for LongTensor positions [T]."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by its rows' positions; with partial RoPE (cos/sin
    narrower than a head) only the leading ``rotary_dim`` dimensions rotate."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + rotate_half(head) * sin, tail), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM-5 / DeepSeek layout: pairs (x0, x1), (x2, x3)... each rotated by one frequency;
    the result holds the rotated even elements, then the odd ones (transformers' layout)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
