"""Tensor helpers shared by the layer modules: RMSNorm, parameter allocation, checked loads."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.errors import InvalidModelConfigError

Getter = Callable[[str], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def take(weights: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``weights[name]`` after checking its shape (the caller checked presence)."""
    t = weights[name]
    if tuple(t.shape) != shape:
        raise InvalidModelConfigError(
            f"checkpoint tensor {name} has shape {tuple(t.shape)}, the config implies {shape}"
        )
    return t
