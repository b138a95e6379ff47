"""config.json fields: one left out means what transformers' configuration class assumes for
that family; one asking for what we do not implement (an attention kind, a RoPE scaling, a
layer type, the LM head's layout) is refused naming the field, never served differently."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import transformers

from prefill_node.errors import (
    InvalidModelConfigError,
    MissingTensorError,
    UnsupportedArchitectureError,
)
from prefill_node.model.config import ModelConfig
from prefill_node.model.loader_hf import load_hf_config, load_stage_model, save_hf_checkpoint
from prefill_node.model.partition import LayerRange
from prefill_node.model.weights import EMBED, LM_HEAD, random_weights
from tests.tiny_models import (
    TINY_GLM5_HF,
    TINY_KIMI_HF,
    TINY_LLAMA_HF,
    TINY_MINIMAX_M2_HF,
    TINY_QWEN3_NEXT_HF,
    tiny_llama,
    tiny_qwen3,
)

HF = {
    "llama": TINY_LLAMA_HF,
    "qwen3": tiny_qwen3("q3", 256).to_hf_config(),
    "minimax_m2": TINY_MINIMAX_M2_HF,
    "glm_moe_dsa": TINY_GLM5_HF,
    "qwen3_next": TINY_QWEN3_NEXT_HF,
    "kimi_linear": TINY_KIMI_HF,
}
# Fields with a class default in transformers that a hand-written config may leave out.
OMITTABLE = (
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)


@pytest.mark.parametrize("family", sorted(HF))
def test_omitted_fields_mean_what_transformers_assumes(family):
    d = {k: v for k, v in HF[family].items() if k not in OMITTABLE}
    ours = ModelConfig.from_hf_config(d)
    theirs = transformers.AutoConfig.for_model(
        family, **{k: v for k, v in d.items() if k != "model_type"}
    )
    rope = getattr(theirs, "rope_parameters", None) or {}
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    if ours.mla is None:
        assert ours.head_dim == theirs.head_dim
    if family != "kimi_linear":  # Kimi Linear's MLA has no RoPE
        assert ours.rope_theta == rope.get("rope_theta", getattr(theirs, "rope_theta", None))


@pytest.mark.parametrize("family", sorted(HF))
def test_sliding_or_unknown_layer_types_are_refused_naming_the_field(family, tmp_path):
    d = dict(HF[family])
    n = d["num_hidden_layers"]
    for kinds in (["sliding_attention"] * n, ["chunked_attention"] * n):
        (tmp_path / "config.json").write_text(json.dumps({**d, "layer_types": kinds}))
        with pytest.raises(UnsupportedArchitectureError, match=rf"layer_types \['{kinds[0]}'\]"):
            load_hf_config(tmp_path)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "longrope"),
        ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["Gemma3ForCausalLM"]}, "Gemma3ForCausalLM"),
    ],
)
def test_unimplemented_variants_are_refused_naming_the_field(tmp_path, changes, match):
    (tmp_path / "config.json").write_text(json.dumps({**HF["qwen3"], **changes}))
    with pytest.raises(UnsupportedArchitectureError, match=match):
        load_hf_config(tmp_path)


def test_untied_without_a_head_and_tied_beside_another_head_are_refused(tmp_path):
    untied = tiny_llama("untied", tie_word_embeddings=False)
    weights = random_weights(untied, seed=2)
    head = weights.pop(LM_HEAD)
    save_hf_checkpoint(tmp_path / "headless", untied, weights)
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_stage_model(tmp_path / "headless", LayerRange(0, untied.num_layers))

    # tied, but the file also holds a different lm_head.weight: ambiguous (transformers 5
    # serves the stored head, earlier versions the embeddings), so refused; an equal copy loads
    tied = replace(untied, tie_word_embeddings=True)
    save_hf_checkpoint(tmp_path / "tied", untied, {**weights, LM_HEAD: head})
    cfg = json.loads((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "tied" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert load_hf_config(tmp_path / "tied", name="untied") == tied
    load_stage_model(tmp_path / "tied", LayerRange(0, 2))  # a stage without the head loads
    with pytest.raises(InvalidModelConfigError, match="tie_word_embeddings"):
        load_stage_model(tmp_path / "tied", LayerRange(2, 4))
    save_hf_checkpoint(tmp_path / "copy", untied, {**weights, LM_HEAD: weights[EMBED]})
    cfg = json.loads((tmp_path / "copy" / "config.json").read_text())
    (tmp_path / "copy" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    load_stage_model(tmp_path / "copy", LayerRange(2, 4))
