"""`wavepp prefill` as a real subprocess: the default model answers, reuse shows, errors exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefill_node.cli.main import main
from prefill_node.model.config import ModelConfig
from prefill_node.model.loader_hf import save_hf_checkpoint
from prefill_node.model.weights import random_weights

REPO = Path(__file__).resolve().parents[1]


def wavepp(*args: str, cache_dir: Path | None = None, timeout: float = 300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if cache_dir is not None:
        env["WAVEPP_CACHE_DIR"] = str(cache_dir)
    cmd = [sys.executable, "-m", "prefill_node.cli.main", "prefill", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random 4-layer Llama checkpoint without a tokenizer (ids-only prompts)."""
    config = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 50,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        },
        name="tiny-cli",
    )
    path = tmp_path_factory.mktemp("tiny-model")
    save_hf_checkpoint(path, config, random_weights(config, seed=0))
    return path


def test_help_explains_every_flag() -> None:
    out = wavepp("--help")
    assert out.returncode == 0, out.stderr
    for flag in (
        "--ids",
        "--token-ids",
        "--chat",
        "--no-chat",
        "--system",
        "--model",
        "--stages",
        "--repeat",
        "--num-blocks",
        "--block-size",
        "--max-chunk-tokens",
        "--max-model-len",
        "--dtype",
        "--device",
        "--cache-salt",
        "--top-logprobs",
        "--generate",
        "--max-new-tokens",
        "--engine",
        "--policy",
        "--threads",
        "--json",
    ):
        assert flag in out.stdout, flag


@pytest.mark.slow
def test_default_model_answers_and_second_run_reuses_prefix(default_model_cache) -> None:
    cache_dir, _ = default_model_cache
    out = wavepp(
        "--stages", "2", "--repeat", "2", "--generate", "10", "--json",
        "What is the capital of France?",
        cache_dir=cache_dir,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    assert first["cached_tokens"] == 0 and first["computed_tokens"] == first["prompt_tokens"]
    assert second["cached_tokens"] == second["prompt_tokens"] // 16 * 16 > 0
    assert second["first_token_id"] == first["first_token_id"]
    assert "Paris" in first["answer_text"] and first["answer_text"] == second["answer_text"]


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """The same entry point as the console script, without a process start (fast)."""
    code = main(["prefill", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_token_ids_file_with_three_stages_shows_reuse(tiny_model_dir: Path, tmp_path, capsys):
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("1, 2, 3, 4, 5\n6 7 8 9 10 11 12 13 14 15 16 17 18 19 20")
    code, out, err = in_process(
        capsys,
        "--model", str(tiny_model_dir), "--token-ids", str(ids_file),
        "--stages", "3", "--repeat", "2", "--block-size", "4", "--max-chunk-tokens", "6",
        "--engine", "local",
    )  # fmt: skip
    assert code == 0, err
    runs = [line for line in out.splitlines() if line.startswith("[run")]
    assert "cached 0 | computed 20" in runs[0]
    assert "cached 19 | computed 1" in runs[1]  # all 5 blocks reused, last token recomputed
    assert "first token:" in out


def test_multi_process_pipeline_engine_matches_local_engine(tiny_model_dir: Path, capsys):
    """`--engine pipeline` (one process per stage) gives the local engine's first token, top
    logprobs and cached tokens: both reuse every cached block of a wholly cached prompt
    and recompute only its last token (the last block by copy)."""
    common = ["--model", str(tiny_model_dir), "--ids", ",".join(map(str, range(1, 21))),
              "--stages", "3", "--repeat", "2", "--block-size", "4", "--json"]  # fmt: skip
    code, out, err = in_process(capsys, *common, "--max-chunk-tokens", "8", "--engine", "pipeline")
    assert code == 0, err
    piped = [json.loads(line) for line in out.splitlines()]
    code, out, err = in_process(capsys, *common, "--engine", "local")
    assert code == 0, err
    local = [json.loads(line) for line in out.splitlines()]
    assert [r["cached_tokens"] for r in piped] == [r["cached_tokens"] for r in local] == [0, 19]
    assert [r["computed_tokens"] for r in piped] == [20, 1]
    for p, q in zip(piped, local, strict=True):
        assert p["first_token_id"] == q["first_token_id"]
        assert [i for i, _ in p["top_logprobs"]] == [i for i, _ in q["top_logprobs"]]
        for (_, a), (_, b) in zip(p["top_logprobs"], q["top_logprobs"], strict=True):
            assert abs(a - b) < 1e-4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ids", "1,2,50"], "token id 50 at position 2 is outside the vocabulary"),
        (["--ids", "1,x"], "token ids must be integers"),
        (["--ids", ",".join(["1"] * 129)], "max_model_len=128"),
        (["--ids", "1,2,3,4,5", "--num-blocks", "2", "--block-size", "2"], "needs 3 blocks"),
        (["--ids", "1,2,3", "--num-blocks", "1", "--block-size", "2"], "each >= 2"),
        ([], "give a PROMPT, --ids or --token-ids"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tiny_model_dir: Path, args, message, capsys):
    code, _, err = in_process(capsys, "--model", str(tiny_model_dir), *args)
    assert code == 2
    assert message in err


def test_text_prompt_without_tokenizer_is_a_load_error(tiny_model_dir: Path, capsys) -> None:
    code, _, err = in_process(capsys, "--model", str(tiny_model_dir), "hello")
    assert code == 1
    assert "no tokenizer.json" in err
