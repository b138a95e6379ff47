"""Where a checkpoint stores each tensor the model needs: the one table of the other namings
transformers writes and reads for our families, shared by every family and every loader call.

``weights.py`` names each tensor as the official releases do (the canonical name). A
checkpoint may instead hold the same tensor under another name transformers also loads:

- renamed: transformers' load-time renamings (``transformers/conversion_mapping.py``) read
  both sides, and ``save_pretrained`` (5.x) writes the reverse of each renaming, so for
  example Kimi Linear's dense first MLP comes back as ``block_sparse_moe.gate_proj``;
- fused: transformers' in-memory layout (what a plain ``state_dict`` save writes), where one
  tensor holds every expert (``experts.gate_up_proj`` [E, 2I, H] = gate then up,
  ``experts.down_proj`` [E, H, I]) or Kimi's three short convolutions (``conv1d``, q then k
  then v along dim 0); the canonical tensor is one part of it.

``resolve`` tries the canonical name first, then each renaming, each combined with the fused
forms, and returns the first the checkpoint holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

from prefill_node.errors import MissingTensorError
from prefill_node.model.config import ModelConfig, ModelFamily

Part = tuple[int | slice, ...]


@dataclass(frozen=True)
class TensorSource:
    """A canonical tensor as stored: the checkpoint tensor ``name``, or its ``part`` (an
    index into it; empty for the whole tensor)."""

    name: str
    part: Part = ()


@dataclass(frozen=True)
class Renaming:
    """Our name ``pattern`` stands in a checkpoint as ``replacement`` too (``origin`` says
    which transformers mapping or writer uses it)."""

    families: tuple[ModelFamily, ...]
    pattern: str
    replacement: str
    origin: str

    def apply(self, name: str) -> str | None:
        renamed = re.sub(self.pattern, self.replacement, name)
        return renamed if renamed != name else None


@dataclass(frozen=True)
class Fusion:
    """Our name ``pattern`` is one part of a fused checkpoint tensor (``origin`` as above)."""

    families: tuple[ModelFamily, ...]
    pattern: str
    fused: str
    part: Callable[[re.Match[str], ModelConfig], Part]
    origin: str

    def apply(self, name: str, config: ModelConfig) -> TensorSource | None:
        m = re.fullmatch(self.pattern, name)
        if m is None:
            return None
        return TensorSource(m.expand(self.fused), self.part(m, config))


_MOE = (
    ModelFamily.MINIMAX_M2,
    ModelFamily.GLM_MOE_DSA,
    ModelFamily.QWEN3_NEXT,
    ModelFamily.KIMI_LINEAR,
)
_BLOCK_SPARSE_MOE = (ModelFamily.MINIMAX_M2, ModelFamily.KIMI_LINEAR)

RENAMINGS: tuple[Renaming, ...] = (
    Renaming(
        _BLOCK_SPARSE_MOE,
        r"\.block_sparse_moe\.",
        ".mlp.",
        "conversion_mapping 'mixtral' (MiniMax-M2) and 'kimi_linear': "
        "WeightRenaming('.block_sparse_moe.', '.mlp.')",
    ),
    Renaming(
        (ModelFamily.KIMI_LINEAR,),
        r"\.mlp\.(gate_proj|up_proj|down_proj)\.",
        r".block_sparse_moe.\1.",
        "save_pretrained (5.x) reverses '.block_sparse_moe.' -> '.mlp.' on the dense MLP too",
    ),
    Renaming(
        (ModelFamily.KIMI_LINEAR,),
        r"\.self_attn\.(f_a_proj\.|f_b_proj\.|dt_bias$|A_log$)",
        r".self_attn.forget_gate.\1",
        "conversion_mapping 'kimi_linear': the forget gate's tensors under "
        "self_attn.forget_gate (KimiLinearForgetGate)",
    ),
)


def _gate(m: re.Match[str], config: ModelConfig) -> Part:
    width = config.moe.expert_intermediate_size if config.moe else 0
    return (int(m["expert"]), slice(0, width))


def _up(m: re.Match[str], config: ModelConfig) -> Part:
    width = config.moe.expert_intermediate_size if config.moe else 0
    return (int(m["expert"]), slice(width, 2 * width))


def _down(m: re.Match[str], config: ModelConfig) -> Part:
    return (int(m["expert"]),)


def _conv(m: re.Match[str], config: ModelConfig) -> Part:
    width = config.recurrent.key_dim if config.recurrent else 0
    i = "qkv".index(m["which"])
    return (slice(i * width, (i + 1) * width),)


_EXPERT = r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\."
_EXPERT_ORIGIN = (
    "conversion_mapping 'mixtral' / 'qwen2_moe' / 'kimi_linear': per-expert tensors merged "
    "(MergeModulelist) and gate, up concatenated on dim 1"
)
FUSIONS: tuple[Fusion, ...] = (
    Fusion(
        _MOE, _EXPERT + r"(w1|gate_proj)\.weight", r"\g<prefix>.gate_up_proj", _gate, _EXPERT_ORIGIN
    ),
    Fusion(
        _MOE, _EXPERT + r"(w3|up_proj)\.weight", r"\g<prefix>.gate_up_proj", _up, _EXPERT_ORIGIN
    ),
    Fusion(
        _MOE, _EXPERT + r"(w2|down_proj)\.weight", r"\g<prefix>.down_proj", _down, _EXPERT_ORIGIN
    ),
    Fusion(
        (ModelFamily.KIMI_LINEAR,),
        r"(?P<prefix>.+\.self_attn)\.(?P<which>[qkv])_conv1d\.weight",
        r"\g<prefix>.conv1d.weight",
        _conv,
        "conversion_mapping 'kimi_linear': q/k/v_conv1d concatenated on dim 0 as conv1d",
    ),
)


def candidates(name: str, config: ModelConfig) -> list[TensorSource]:
    """Every place ``name`` may be stored, in the order ``resolve`` tries them."""
    family = config.family
    names = [name]
    for renaming in RENAMINGS:
        if family in renaming.families:
            names += [r for n in list(names) if (r := renaming.apply(n)) is not None]
    out = [TensorSource(n) for n in names]
    for fusion in FUSIONS:
        if family in fusion.families:
            out += [s for n in names if (s := fusion.apply(n, config)) is not None]
    return out


def resolve(name: str, config: ModelConfig, stored: Collection[str], where: str) -> TensorSource:
    """Where the checkpoint (whose tensor names are ``stored``, read from ``where``) holds our
    tensor ``name``; MissingTensorError naming every place tried when it holds none."""
    tried = candidates(name, config)
    for source in tried:
        if source.name in stored:
            return source
    others = sorted({s.name for s in tried[1:]})
    also = f" (nor as {', '.join(others)})" if others else ""
    raise MissingTensorError(f"tensor {name!r} is missing from {where}{also}")
