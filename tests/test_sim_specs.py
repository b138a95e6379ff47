"""The simulator's model description is the backend's: a preset the backend can run is a
ModelConfig, its ModelSpec is derived from it, and the two cost shapes agree to the FLOP."""

from __future__ import annotations

import pytest

from prefill_node.model.config import ModelConfig
from prefill_node.sim.presets import GLM5, GLM5_CONFIG, MINIMAX_M2, MINIMAX_M2_CONFIG
from prefill_node.sim.specs import InvalidSpecError, ModelSpec
from tests.tiny_models import tiny_glm5, tiny_llama, tiny_minimax_m2, tiny_qwen3_next


def _assert_same_costs(spec: ModelSpec, config: ModelConfig) -> None:
    for layer in range(config.num_layers):
        active = spec.attention_params() + spec.mlp_params(layer)[1]
        assert active == config.active_params_per_token(layer), layer
    assert spec.pair_flops() + spec.index_pair_flops() == config.attention_flops_per_pair()
    entry = 2 * config.kv_size if config.mla is None else config.mla.entry_width
    assert spec.kv_bytes_per_token_layer() == entry * spec.kv_bytes


@pytest.mark.parametrize(("spec", "config"), [(GLM5, GLM5_CONFIG), (MINIMAX_M2, MINIMAX_M2_CONFIG)])
def test_presets_are_derived_from_the_backends_config(spec, config) -> None:
    assert spec.name == config.name
    _assert_same_costs(spec, config)


@pytest.mark.parametrize("make", [tiny_llama, tiny_minimax_m2, tiny_glm5])
def test_any_backend_model_has_the_same_cost_shape_in_the_simulator(make) -> None:
    config = make()
    spec = ModelSpec.from_config(config, weight_bytes=2.0, kv_bytes=2.0)
    assert (spec.is_mla, spec.num_experts > 0) == (config.mla is not None, config.moe is not None)
    _assert_same_costs(spec, config)


def test_recurrent_layers_are_refused_by_name() -> None:
    with pytest.raises(InvalidSpecError, match="recurrent"):
        ModelSpec.from_config(tiny_qwen3_next(), weight_bytes=2.0, kv_bytes=2.0)
