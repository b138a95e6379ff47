"""Kimi Linear (kimi_linear: KDA + MLA without indexer/RoPE + grouped MoE) against transformers.

Layer level: our KDA layer equals transformers' ``KimiLinearDeltaAttention`` (same weights,
fp32) for a prompt in one shot and in two chunks carrying the state - outputs, recurrent state
and conv tail, compared with what transformers' own cache holds - and our MLA layer equals
``KimiLinearAttention`` over a paged latent cache, in one shot and chunked. Config level: the
released config.json spelling parses, round-trips and names what we do not implement; a
checkpoint we write loads into transformers with no missing or unexpected tensor.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.models.kimi_linear import modeling_kimi_linear as kimi_hf

from prefill_node.errors import InvalidModelConfigError, UnsupportedArchitectureError
from prefill_node.model.attention import AttentionPlan
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig, ModelFamily, MoeConfig, RecurrentConfig
from prefill_node.model.kda import KdaAttention
from prefill_node.model.latent_cache import PagedLatentCache
from prefill_node.model.loader_hf import load_hf_config, save_hf_checkpoint
from prefill_node.model.mla import MlaAttention
from prefill_node.model.partition import LayerRange
from prefill_node.model.rope import RotaryEmbedding
from prefill_node.model.tensor_ops import take
from prefill_node.model.weights import KDA_CONVS, random_weights, weight_shapes
from tests.tiny_models import TINY_KIMI_HF, tiny_kimi

ATOL = 1e-4
CONFIG = tiny_kimi()
WEIGHTS = random_weights(CONFIG, seed=7)
PROMPT = 40
CUT = 17  # not a multiple of the delta rule's chunk or the conv width


def hf_config():
    config = transformers.KimiLinearConfig.from_dict(CONFIG.to_hf_config())
    config._attn_implementation = "eager"
    return config


def getter(layer: int):
    p, shapes = f"model.layers.{layer}.self_attn.", weight_shapes(CONFIG)
    return lambda suffix: take(WEIGHTS, p + suffix, shapes[p + suffix])


def hf_kda(layer: int):
    """transformers' KDA layer with our weights (its conv is the three convs stacked)."""
    p = f"model.layers.{layer}.self_attn."
    w = {n[len(p) :]: t for n, t in WEIGHTS.items() if n.startswith(p)}
    state = {n: w[n] for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    state["conv1d.weight"] = torch.cat([w[c] for c in KDA_CONVS])
    for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        state["forget_gate." + n] = w[n]
    for n in ("b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "o_norm.weight"):
        state[n] = w[n]
    state["o_proj.weight"] = w["o_proj.weight"]
    module = kimi_hf.KimiLinearDeltaAttention(hf_config(), layer).eval()
    module.load_state_dict(state, strict=True)
    return module


def ours_kda(layer: int) -> KdaAttention:
    attn = KdaAttention(CONFIG, layer, torch.float32, torch.device("cpu"))
    attn.load(getter(layer))
    return attn


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, CONFIG.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layer", [0, 3])
def test_kda_layer_matches_transformers_in_one_shot_and_in_two_chunks(layer):
    x = rows(PROMPT, layer)
    hf, ours = hf_kda(layer), ours_kda(layer)
    cache = transformers.DynamicCache(config=hf_config())
    with torch.no_grad():
        hf_first = hf(x[None, :CUT], cache=cache)[0]
        hf_second = hf(x[None, CUT:], cache=cache)[0]
        hf_whole = hf(x[None])[0]
    hf_state = cache.layers[layer].recurrent_states[0][0]
    hf_tail = cache.layers[layer].conv_states[0][0, :, 1:].T  # it keeps K columns, we K - 1
    torch.testing.assert_close(torch.cat([hf_first, hf_second]), hf_whole, atol=ATOL, rtol=0)

    whole = ours.run_sequence(x, ours.initial_state(), offsets=(CUT,))
    torch.testing.assert_close(whole.out, hf_whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(whole.state.recurrent, hf_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(whole.state.conv_tail, hf_tail, atol=ATOL, rtol=0)

    first = ours.run_sequence(x[:CUT], ours.initial_state())
    second = ours.run_sequence(x[CUT:], first.state)
    torch.testing.assert_close(first.out, hf_first, atol=ATOL, rtol=0)
    torch.testing.assert_close(second.out, hf_second, atol=ATOL, rtol=0)
    torch.testing.assert_close(second.state.recurrent, hf_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(second.state.conv_tail, hf_tail, atol=ATOL, rtol=0)
    (snapshot,) = whole.snapshots  # the state after CUT rows, taken in the one-shot pass
    torch.testing.assert_close(snapshot.recurrent, first.state.recurrent, atol=ATOL, rtol=0)
    torch.testing.assert_close(snapshot.conv_tail, first.state.conv_tail, atol=0, rtol=0)


def test_kda_second_chunk_depends_on_both_parts_of_the_state():
    """Guard against a test that cannot fail: dropping the carried recurrent matrix, or just
    the conv tail, changes the second chunk's output."""
    ours = ours_kda(0)
    x = rows(PROMPT, 1)
    first = ours.run_sequence(x[:CUT], ours.initial_state())
    carried = ours.run_sequence(x[CUT:], first.state).out
    fresh = ours.run_sequence(x[CUT:], ours.initial_state()).out
    zero_tail = first.state._replace(conv_tail=torch.zeros_like(first.state.conv_tail))
    no_tail = ours.run_sequence(x[CUT:], zero_tail).out
    assert (carried - fresh).abs().max() > 1e-2
    assert (carried[:3] - no_tail[:3]).abs().max() > 1e-3  # the conv reaches 3 rows back


def mla_plan(start: int, end: int, table: tuple[int, ...], cache: PagedLatentCache):
    batch = ChunkBatch((ChunkSpec(start, end - start, table),))
    return batch, AttentionPlan.build(batch, cache, torch.float32)


def test_kimi_mla_layer_matches_transformers_in_one_shot_and_chunked():
    layer = 2
    assert not CONFIG.is_linear_layer(layer)
    hf = kimi_hf.KimiLinearAttention(hf_config(), layer).eval()
    p = f"model.layers.{layer}.self_attn."
    hf.load_state_dict({n[len(p) :]: t for n, t in WEIGHTS.items() if n.startswith(p)})
    ours = MlaAttention(CONFIG, layer, torch.float32, torch.device("cpu"))
    ours.load(getter(layer))
    x = rows(PROMPT, 5)
    mask = torch.full((PROMPT, PROMPT), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected = hf(x[None], mask)[0][0]
    rotary = RotaryEmbedding(CONFIG, torch.device("cpu"))
    table = tuple(reversed(range(10)))
    for cuts in ((0, PROMPT), (0, CUT, PROMPT)):
        cache = PagedLatentCache(CONFIG.mla, LayerRange(layer, layer + 1), 10, 4)
        for start, end in zip(cuts, cuts[1:], strict=False):
            batch, plan = mla_plan(start, end, table, cache)
            cos, sin = rotary.cos_sin(batch.positions(torch.device("cpu")), torch.float32)
            out = ours(x[start:end], cos, sin, plan, cache)
            torch.testing.assert_close(out, expected[start:end], atol=ATOL, rtol=0)
    assert cache.entry_parts == (16, 8, 0)


def test_release_style_config_parses_and_round_trips():
    assert CONFIG.family is ModelFamily.KIMI_LINEAR
    assert CONFIG.recurrent == RecurrentConfig(
        layers=(0, 1, 3),
        num_key_heads=4,
        num_value_heads=4,
        key_head_dim=8,
        value_head_dim=8,
        conv_kernel=4,
    )
    assert CONFIG.moe == MoeConfig(
        num_experts=8,
        top_k=2,
        expert_intermediate_size=16,
        num_groups=2,
        topk_groups=1,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        first_dense_layers=1,
    )
    m = CONFIG.mla
    assert (m.q_lora_rank, m.rotary, m.has_indexer, m.entry_width) == (None, False, False, 24)
    assert CONFIG.max_position_embeddings == 256
    assert ModelConfig.from_hf_config(CONFIG.to_hf_config(), name="tiny-kimi") == CONFIG
    hf = hf_config()  # transformers reads our config.json the same way
    assert hf.layer_types == ["linear_attention"] * 2 + ["full_attention", "linear_attention"]
    assert hf.mlp_layer_types == ["dense"] + ["sparse"] * 3
    assert (hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim) == (4, 8, 4)
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.n_group) == (8, 2, 2)
    # transformers' own layer_types (what its save_pretrained writes) win over linear_attn_config
    saved = {**TINY_KIMI_HF, "layer_types": hf.layer_types[::-1]}
    assert ModelConfig.from_hf_config(saved).recurrent.layers == (0, 2, 3)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"mla_use_nope": False}, UnsupportedArchitectureError, "mla_use_nope"),
        ({"mla_use_output_gate": True}, UnsupportedArchitectureError, "mla_use_output_gate"),
        ({"moe_router_activation_func": "softmax"}, UnsupportedArchitectureError, "activation"),
        ({"moe_layer_freq": 2}, UnsupportedArchitectureError, "moe_layer_freq"),
        ({"moe_renormalize": False}, UnsupportedArchitectureError, "moe_renormalize"),
        ({"use_grouped_topk": False}, UnsupportedArchitectureError, "use_grouped_topk"),
        ({"routed_expert_hidden_size": 64}, UnsupportedArchitectureError, "routed_expert"),
        (
            {"linear_attn_config": {**TINY_KIMI_HF["linear_attn_config"], "gate_lower_bound": -5}},
            UnsupportedArchitectureError,
            "gate_lower_bound",
        ),
        ({"mlp_layer_types": ["sparse"] * 4}, UnsupportedArchitectureError, "mlp_layer_types"),
        ({"layer_types": ["sliding_attention"] * 4}, UnsupportedArchitectureError, "sliding"),
        (
            {"linear_attn_config": {**TINY_KIMI_HF["linear_attn_config"], "kda_layers": [1, 2]}},
            InvalidModelConfigError,
            "each of the 4 layers",
        ),
        ({"num_experts_per_token": 9}, InvalidModelConfigError, "top_k"),
        (
            {"linear_attn_config": {**TINY_KIMI_HF["linear_attn_config"], "num_heads": 0}},
            InvalidModelConfigError,
            "heads must be a positive int",
        ),
    ],
)
def test_unsupported_kimi_variants_raise_typed_errors(tmp_path, changes, error, match):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_KIMI_HF, **changes}))
    with pytest.raises(error, match=match):
        load_hf_config(tmp_path)


def test_our_checkpoint_loads_into_transformers_with_every_tensor_named(tmp_path):
    save_hf_checkpoint(tmp_path, CONFIG, WEIGHTS)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "KimiLinearForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    layer1 = model.model.layers[1]
    torch.testing.assert_close(
        layer1.self_attn.forget_gate.A_log, WEIGHTS["model.layers.1.self_attn.A_log"]
    )
    expert3 = WEIGHTS["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    torch.testing.assert_close(layer1.mlp.experts.gate_up_proj[3, 16:], expert3)
