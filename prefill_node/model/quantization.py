"""Quantised Hugging Face checkpoints: which ``quantization_config`` loads, and how its weights
become the serving dtype.

One scheme loads: block-wise FP8 as the official FP8 releases lay it out (DeepSeek-V3,
Qwen3-*-FP8, MiniMax-M2, GLM FP8): ``quant_method: fp8``, ``float8_e4m3fn`` weights, and next
to each quantised ``X.weight`` a float32 ``X.weight_scale_inv`` holding one multiplier per
``weight_block_size`` block (a grid of ceil(rows / block) x ceil(cols / block); the last block
of a row or column may be partial). The loader dequantises each tensor on its own as it
reads it (``q.float() * scale`` per block, then the serving dtype, the arithmetic of
transformers' own dequantising load), so no second copy of the model is ever held.
Activations are computed in the serving dtype: ``activation_scheme: dynamic`` (activations
quantised on the fly at serving time) is what these releases use and needs nothing stored.

Anything else (another ``quant_method`` such as gptq, awq, compressed-tensors or bitsandbytes,
FP8 with per-tensor scales or static activation scales, e5m2) is refused when the config is
parsed, with one line naming the field and what is supported, and so is a low-precision
tensor that arrives without its scale: a checkpoint is never served wrong.

Torch-free (the config side is parsed by torch-free code): ``dequantize`` only calls methods
of the tensors it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefill_node.errors import InvalidModelConfigError, UnsupportedQuantizationError

if TYPE_CHECKING:
    import torch

SCALE_SUFFIX = "_scale_inv"
SUPPORTED = (
    "quant_method fp8 with fmt e4m3, weight_block_size [rows, cols] and "
    "activation_scheme dynamic (block-wise FP8 as in the official FP8 releases), "
    "or an unquantised checkpoint"
)
# What the released configs write for e4m3 (DeepSeek-V3 / Qwen3: "e4m3"; MiniMax-M2 spells
# the torch dtype).
_E4M3_NAMES = ("e4m3", "float8_e4m3fn")
_FP8_STORAGE = "float8_e4m3fn"
# Scale dtypes the releases store: float32 (most), bfloat16, or E8M0 exponents (ue8m0 scales).
_SCALE_DTYPES = ("float32", "bfloat16", "float16", "float8_e8m0fnu")


@dataclass(frozen=True)
class Fp8BlockQuantization:
    """Block-wise FP8 weights: each ``block_rows x block_cols`` block of a quantised weight is
    ``float8_e4m3fn`` values times one float multiplier stored in ``<name>_scale_inv``."""

    block_rows: int
    block_cols: int
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_rows <= 0 or self.block_cols <= 0:
            raise InvalidModelConfigError(
                "quantization_config.weight_block_size must be two positive ints, got "
                f"[{self.block_rows}, {self.block_cols}]"
            )

    @classmethod
    def from_hf(cls, q: Mapping[str, Any]) -> Fp8BlockQuantization:
        """Validate a ``quant_method: fp8`` ``quantization_config``; anything this loader
        does not implement raises UnsupportedQuantizationError naming the field."""
        fmt = q.get("fmt", "e4m3")
        if fmt not in _E4M3_NAMES:
            raise UnsupportedQuantizationError(
                f"quantization_config.fmt {fmt!r} is not supported; supported: {SUPPORTED}"
            )
        scheme = q.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise UnsupportedQuantizationError(
                f"quantization_config.activation_scheme {scheme!r} is not supported; "
                f"supported: {SUPPORTED}"
            )
        block = q.get("weight_block_size")
        if block is None:
            raise UnsupportedQuantizationError(
                "quantization_config without weight_block_size (FP8 with per-tensor scales) is "
                f"not supported; supported: {SUPPORTED}"
            )
        if not isinstance(block, list | tuple) or len(block) != 2:
            raise InvalidModelConfigError(
                f"quantization_config.weight_block_size must be [rows, cols], got {block!r}"
            )
        skip = q.get("modules_to_not_convert") or ()
        return cls(int(block[0]), int(block[1]), tuple(str(m) for m in skip))

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [self.block_rows, self.block_cols],
        }
        if self.modules_to_not_convert:
            d["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return d

    def scale_grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The ``weight_scale_inv`` shape of a weight of ``shape``: leading dims as they are,
        then ceil(rows / block_rows) x ceil(cols / block_cols)."""
        *lead, rows, cols = shape
        return (*lead, -(-rows // self.block_rows), -(-cols // self.block_cols))

    def dequantize(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``weight`` (float8_e4m3fn, ``[..., rows, cols]``) times its per-block ``scale``, as
        ``dtype``. Computed in float32 and cast once, as transformers' dequantising load
        does. A scale grid that does not match the weight raises InvalidModelConfigError."""
        if str(weight.dtype).removeprefix("torch.") != _FP8_STORAGE:
            raise UnsupportedQuantizationError(
                f"tensor {name!r} has a {name}{SCALE_SUFFIX} scale but is stored as "
                f"{weight.dtype}, not {_FP8_STORAGE}; supported: {SUPPORTED}"
            )
        if str(scale.dtype).removeprefix("torch.") not in _SCALE_DTYPES:
            raise UnsupportedQuantizationError(
                f"tensor {name}{SCALE_SUFFIX} is stored as {scale.dtype}; supported scale "
                f"dtypes: {', '.join(_SCALE_DTYPES)}"
            )
        grid = self.scale_grid(tuple(weight.shape))
        if tuple(scale.shape) != grid:
            raise InvalidModelConfigError(
                f"{name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}, but a weight of shape "
                f"{tuple(weight.shape)} in {self.block_rows}x{self.block_cols} blocks needs "
                f"{grid}"
            )
        rows, cols = weight.shape[-2:]
        out = weight.float()
        # scales expanded over rows only; columns broadcast through a blocked view of ``out``
        per_row = scale.float().repeat_interleave(self.block_rows, dim=-2)[..., :rows, :]
        full, rest = divmod(cols, self.block_cols)
        out[..., : full * self.block_cols].unflatten(-1, (full, self.block_cols)).mul_(
            per_row[..., :full, None]
        )
        if rest:
            out[..., full * self.block_cols :].mul_(per_row[..., full:])
        return out.to(dtype)


def quantization_of(d: Mapping[str, Any]) -> Fp8BlockQuantization | None:
    """The checkpoint's weight quantisation from a ``config.json`` dict: None when it has no
    ``quantization_config``; UnsupportedQuantizationError for any scheme we do not load."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise InvalidModelConfigError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise UnsupportedQuantizationError(
            f"quantization_config.quant_method {method!r} is not supported; supported: {SUPPORTED}"
        )
    return Fp8BlockQuantization.from_hf(q)
