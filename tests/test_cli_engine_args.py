"""`wavepp serve` and `wavepp prefill` share one set of engine flags with EngineConfig's
defaults, and both read them back into the same EngineConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefill_node.cli.main import build_parser
from prefill_node.cli.options import engine_spec
from prefill_node.errors import InvalidRequestError
from prefill_node.runtime.engine_config import EngineConfig, config_defaults

SHARED = (
    "policy",
    "num_blocks",
    "block_size",
    "max_wave_tokens",
    "min_wave_tokens",
    "wave_overhead_tokens",
    "max_model_len",
    "dtype",
    "device",
)


def _spec(argv: list[str]) -> EngineConfig:
    args = build_parser().parse_args(argv)
    return engine_spec(args, Path("/model"))


def test_serve_and_prefill_build_the_same_spec_from_their_defaults() -> None:
    serve = _spec(["serve"])
    prefill = _spec(["prefill", "hello"])
    defaults = EngineConfig(model_dir=Path("/model"))
    for name in SHARED:
        assert getattr(serve, name) == getattr(prefill, name) == getattr(defaults, name), name
    assert (serve.stages, prefill.stages) == (2, 1)  # the one per-command default


def test_flags_reach_the_spec() -> None:
    argv = [
        "--num-blocks",
        "64,32",
        "--block-size",
        "8",
        "--max-chunk-tokens",
        "64",
        "--min-wave-tokens",
        "16",
        "--wave-overhead-tokens",
        "24",
        "--dtype",
        "bfloat16",
        "--policy",
        "trtllm",
        "--engine",
        "local",
    ]
    for command in (["serve", "--stages", "2"], ["prefill", "x", "--stages", "2"]):
        spec = _spec(command + argv)
        assert spec.num_blocks == (64, 32) and spec.block_size == 8
        assert (spec.max_wave_tokens, spec.min_wave_tokens) == (64, 16)
        assert spec.wave_overhead_tokens == 24
        assert spec.pipeline_spec(spec.stage_layers(4)).wave_overhead_tokens == 24
        assert (spec.dtype, spec.policy) == ("bfloat16", "trtllm")
        assert build_parser().parse_args(command + argv).engine == "local"  # the transport


def test_bad_values_are_typed_errors() -> None:
    with pytest.raises(InvalidRequestError, match="--num-blocks must be integers"):
        _spec(["serve", "--num-blocks", "a,b"])
    with pytest.raises(InvalidRequestError, match="--num-blocks"):
        _spec(["prefill", "x", "--stages", "3", "--num-blocks", "8,8"])
    with pytest.raises(InvalidRequestError, match="--wave-overhead-tokens must be >= 0"):
        _spec(["serve", "--wave-overhead-tokens", "-1"])


def test_help_shows_the_spec_defaults() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["prefill"].format_help()
    d = config_defaults()
    assert f"(default {d['num_blocks'][0]})" in " ".join(text.split())
