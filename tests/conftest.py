"""Shared pytest setup: single-threaded torch (deterministic, fair on 2 cores)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ---- the real default model (SmolLM2-135M-Instruct), converted once per test session ----

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    """A fresh WAVEPP_CACHE_DIR holding the converted default model: ``(cache_dir, result)``
    where ``result`` is the first ``ensure_default_model`` call's ConversionResult. Pass
    ``WAVEPP_CACHE_DIR=cache_dir`` to subprocesses so they reuse the conversion."""
    from prefill_node.model.default_model import ensure_default_model

    cache_dir = tmp_path_factory.mktemp("wavepp-cache")
    return cache_dir, ensure_default_model(cache_dir / "models")


@pytest.fixture(scope="session")
def default_model_dir(default_model_cache):
    """Path of the converted default model directory (HF layout)."""
    return default_model_cache[1].path
