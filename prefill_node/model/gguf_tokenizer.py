"""Rebuild a ``tokenizers`` byte-level BPE tokenizer (tokenizer.json) from GGUF metadata.

A GGUF stores the vocabulary, merges, token types and special ids under ``tokenizer.ggml.*``
and the pre-tokenizer only as a name (``tokenizer.ggml.pre``). We map that name to the split
rules llama.cpp applies for it (llama.cpp's ``llama-vocab.cpp``), so token ids equal what
llama.cpp and the original Hugging Face tokenizer produce. For example ``smollm`` splits every
digit on its own before the GPT-2 regex, like SmolLM2's own tokenizer.json.
Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) is supported; sentencepiece-style
vocabularies raise UnsupportedArchitectureError.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefill_node.errors import UnsupportedArchitectureError

CONTROL_TOKEN = 3  # llama.cpp token type: special, never produced by BPE on plain text
USER_DEFINED_TOKEN = 4  # added token matched whole in text, not special

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split digits one by one first?, regex); None = GPT-2's built-in regex.
PRE_TOKENIZERS: dict[str, tuple[bool, str | None]] = {
    "default": (False, None),
    "gpt2": (False, None),
    "smollm": (True, None),
    "starcoder": (True, None),
    "refact": (True, None),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The tokenizer part of a GGUF's metadata, decoded."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos, then end-of-turn when it differs."""
        ids = [i for i in (self.eos_token_id, self.eot_token_id) if i is not None]
        return tuple(dict.fromkeys(ids))


def read_tokenizer_spec(reader: Any) -> GGUFTokenizerSpec:
    """Decode the ``tokenizer.*`` metadata of an open ``gguf.GGUFReader``."""

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"tokenizer.{key}")
        return default if field is None else field.contents()

    tokens = tuple(get("ggml.tokens", ()))
    return GGUFTokenizerSpec(
        model=str(get("ggml.model", "")),
        pre=str(get("ggml.pre", "default")),
        tokens=tokens,
        token_types=tuple(int(t) for t in get("ggml.token_type", (1,) * len(tokens))),
        merges=tuple(get("ggml.merges", ())),
        bos_token_id=get("ggml.bos_token_id"),
        eos_token_id=get("ggml.eos_token_id"),
        eot_token_id=get("ggml.eot_token_id"),
        unk_token_id=get("ggml.unknown_token_id"),
        pad_token_id=get("ggml.padding_token_id"),
        add_bos_token=bool(get("ggml.add_bos_token", False)),
        add_eos_token=bool(get("ggml.add_eos_token", False)),
        chat_template=get("chat_template"),
    )


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer(spec: GGUFTokenizerSpec) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's (byte-level BPE only)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    if spec.model != "gpt2":
        raise UnsupportedArchitectureError(
            f"GGUF tokenizer model {spec.model!r} is not supported; only 'gpt2' (byte-level BPE)"
        )
    if spec.pre not in PRE_TOKENIZERS:
        raise UnsupportedArchitectureError(
            f"GGUF pre-tokenizer {spec.pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
        )
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(spec.tokens):
        if not set(token) <= spelled:  # mislabelled raw text: respell its UTF-8 bytes
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))

    digits_first, split = PRE_TOKENIZERS[spec.pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits_first else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()

    specials = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(spec.tokens, spec.token_types, strict=True)
        if kind == CONTROL_TOKEN and set(tok) <= spelled
    ]
    user = [
        AddedToken(tok, special=False, normalized=False)
        for tok, kind in zip(spec.tokens, spec.token_types, strict=True)
        if kind == USER_DEFINED_TOKEN and tok in vocab
    ]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(user)
    tokenizer.post_processor = _post_processor(spec, processors)
    return tokenizer


def _post_processor(spec: GGUFTokenizerSpec, processors: Any) -> Any:
    """ByteLevel offsets, plus BOS/EOS insertion when the GGUF asks for it."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos = (
        spec.tokens[spec.bos_token_id]
        if spec.add_bos_token and spec.bos_token_id is not None
        else None
    )
    eos = (
        spec.tokens[spec.eos_token_id]
        if spec.add_eos_token and spec.eos_token_id is not None
        else None
    )
    if bos is None and eos is None:
        return byte_level
    single = " ".join(x for x in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if x)
    pair = " ".join(x for x in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if x)
    special = [(t, spec.tokens.index(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    return processors.Sequence([byte_level, template])


def tokenizer_config(spec: GGUFTokenizerSpec, model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` dict: special tokens, BOS/EOS flags, chat template."""

    def token(index: int | None) -> str | None:
        return spec.tokens[index] if index is not None and 0 <= index < len(spec.tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(spec.bos_token_id),
        "eos_token": token(spec.eos_token_id),
        "unk_token": token(spec.unk_token_id),
        "pad_token": token(spec.pad_token_id),
        "add_bos_token": spec.add_bos_token,
        "add_eos_token": spec.add_eos_token,
        "eos_token_ids": list(spec.eos_token_ids),
        "model_max_length": model_max_length,
        "chat_template": spec.chat_template,
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer_files(spec: GGUFTokenizerSpec, directory: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``spec`` into ``directory``."""
    build_tokenizer(spec).save(str(directory / "tokenizer.json"))
    config = tokenizer_config(spec, model_max_length)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
