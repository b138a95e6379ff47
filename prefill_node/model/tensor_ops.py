"""Tensor helpers shared by the layer modules: RMSNorm, the matmul, parameter allocation,
checked loads."""

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


# oneDNN's matmul on a weight reordered once into its blocked layout ("prepacked", as vLLM's
# CPU build and torch's inductor do) runs fp32 at about 1.7x the speed of F.linear, which on
# this CPU goes to MKL, whose non-Intel kernels are slower on an AMD EPYC (SmolLM2-135M, one
# thread: bench/forward.py --matmul onednn|f-linear). bf16 F.linear already goes to oneDNN,
# but reorders the weight on every call: prepacked, SmolLM2-135M's bf16 products run 1-10%
# faster with the same bits (docs/models.md).
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACKED_DTYPES = (torch.float32,) + (
    (torch.bfloat16,) if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ()
)
_PACKED = "_wavepp_onednn"  # attribute on the weight Parameter: (its _version, packed weight)
_use_onednn = _ONEDNN


def set_onednn_matmul(enabled: bool) -> None:
    """Choose the fp32 and bf16 matmul: oneDNN on prepacked weights (default where torch has
    it) or F.linear (for comparison: bench/forward.py --matmul)."""
    global _use_onednn
    _use_onednn = enabled and _ONEDNN


ROW_BUCKET = 32  # oneDNN gets row counts in multiples of this (see ``linear``)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``. A float32 or bfloat16 CPU weight Parameter (bf16 where the CPU has
    oneDNN's bf16 kernels) is packed for oneDNN on first use and repacked whenever it was
    written since (its ``_version``); anything else (views such as one expert's slice, other
    dtypes or devices, inputs of another dtype) goes to F.linear.

    oneDNN caches a compiled kernel per problem shape, up to 1,024 of them: fed every row
    count a server sees, a process grew by hundreds of MiB (docs/models.md). So it sees
    rows in multiples of ``ROW_BUCKET`` only (zero rows padded, then dropped: a handful of
    shapes per weight), and fewer rows than that go to F.linear."""
    rows = x.shape[0] if x.dim() == 2 else -1
    if not (
        _use_onednn
        and rows >= ROW_BUCKET
        and isinstance(weight, nn.Parameter)
        and weight.dtype in _PACKED_DTYPES
        and x.dtype == weight.dtype
        and weight.device.type == "cpu"
    ):
        return F.linear(x, weight)
    cached = getattr(weight, _PACKED, None)
    if cached is None or cached[0] != weight._version:
        cached = (weight._version, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        setattr(weight, _PACKED, cached)
    padded = -(-rows // ROW_BUCKET) * ROW_BUCKET
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    out = torch.ops.mkldnn._linear_pointwise(x, cached[1], None, "none", [], "")
    return out[:rows] if padded != rows else out


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
