"""The gated delta rule and the causal conv against transformers' torch references (Qwen3-Next's
per-head decay, Kimi Linear's per-channel KDA decay): outputs, final states, the states at
requested offsets, and chunked runs carrying the state == one run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.kimi_linear import modeling_kimi_linear as kimi
from transformers.models.qwen3_next import modeling_qwen3_next as qwen

from prefill_node.errors import InvariantError
from prefill_node.model.recurrent import (
    causal_conv1d,
    conv_tails,
    gated_delta_rule,
    gated_delta_rule_states,
    l2_normalize,
)

ATOL = 1e-4
HEADS, DK, DV = 3, 8, 6


def _inputs(seq: int, per_channel: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rnd(seq, HEADS, DK), rnd(seq, HEADS, DK), rnd(seq, HEADS, DV)
    beta = torch.sigmoid(rnd(seq, HEADS))
    decay_shape = (seq, HEADS, DK) if per_channel else (seq, HEADS)
    rate = torch.rand(HEADS, generator=gen).mul(4).exp().mul(0.1)  # per head, as A_log gives
    g = -(rate[:, None] if per_channel else rate) * F.softplus(rnd(*decay_shape))
    state = rnd(HEADS, DK, DV) * 0.3
    return q, k, v, g, beta, state


def _hf(q, k, v, g, beta, state, per_channel: bool, recurrent: bool = False):
    """transformers' reference on a batch of one, with q/k normalised in the kernel."""
    args = [t.unsqueeze(0) for t in (q, k, v, g, beta)]
    init = state.unsqueeze(0).clone()
    fns = {
        (False, False): qwen.torch_chunk_gated_delta_rule,
        (False, True): qwen.torch_recurrent_gated_delta_rule,
        (True, False): kimi.chunk_kimi_delta_attention,
        (True, True): kimi.recurrent_kimi_delta_attention,
    }
    fn = fns[per_channel, recurrent]
    out, final = fn(
        *args, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    return out[0], final[0]


def _ours(q, k, v, g, beta, state):
    return gated_delta_rule(l2_normalize(q), l2_normalize(k), v, g, beta, state)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
@pytest.mark.parametrize("seq", [1, 7, 64, 150])
def test_matches_transformers_chunked_reference(per_channel, seq):
    inputs = _inputs(seq, per_channel, seed=seq)
    out, final = _ours(*inputs)
    ref_out, ref_final = _hf(*inputs, per_channel=per_channel)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, ref_final, atol=ATOL, rtol=0)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_matches_transformers_token_by_token_reference(per_channel):
    inputs = _inputs(40, per_channel, seed=3)
    out, final = _ours(*inputs)
    ref_out, ref_final = _hf(*inputs, per_channel=per_channel, recurrent=True)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, ref_final, atol=ATOL, rtol=0)


@settings(max_examples=12, deadline=None)
@given(
    seq=st.integers(1, 140),
    cuts=st.lists(st.integers(0, 140), max_size=4),
    per_channel=st.booleans(),
    chunk=st.sampled_from([4, 16, 64]),
)
def test_states_at_offsets_equal_prefix_runs_and_resuming(seq, cuts, per_channel, chunk):
    q, k, v, g, beta, state = _inputs(seq, per_channel, seed=seq)
    q, k = l2_normalize(q), l2_normalize(k)
    offsets = sorted({min(c, seq) for c in cuts} | {seq})
    out, states = gated_delta_rule_states(q, k, v, g, beta, state, offsets, chunk)
    whole_out, whole_final = gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(out, whole_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(states[-1], whole_final, atol=ATOL, rtol=0)
    # each state is the prefix's final state, and resuming from it gives the rest
    prev, carried = 0, state
    for offset, snap in zip(offsets, states, strict=True):
        sl = slice(prev, offset)
        part_out, carried = gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], carried)
        torch.testing.assert_close(part_out, whole_out[sl], atol=ATOL, rtol=0)
        torch.testing.assert_close(snap, carried, atol=ATOL, rtol=0)
        prev = offset


def test_empty_sequence_returns_the_state():
    q, k, v, g, beta, state = _inputs(0, False, seed=0)
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    assert out.shape == (0, HEADS, DV)
    assert torch.equal(final, state)


def test_shape_mismatch_is_an_invariant_error():
    q, k, v, g, beta, state = _inputs(5, False, seed=0)
    with pytest.raises(InvariantError, match="shapes"):
        gated_delta_rule(q, k, v, g, beta, state[:, :, :2])
    with pytest.raises(InvariantError, match="offsets"):
        gated_delta_rule_states(q, k, v, g, beta, state, (6,))


@pytest.mark.parametrize("split", [0, 1, 5, 11])
def test_causal_conv_matches_transformers_and_carries_its_tail(split):
    gen = torch.Generator().manual_seed(split)
    width, kernel, seq = 10, 4, 11
    x = torch.randn(seq, width, generator=gen)
    weight = torch.randn(width, kernel, generator=gen)
    ref = qwen.causal_conv1d_fn(x.T.unsqueeze(0), weight, None, activation="silu")[0].T
    zero = torch.zeros(kernel - 1, width)
    y, tail = causal_conv1d(x, weight, zero)
    torch.testing.assert_close(F.silu(y), ref, atol=ATOL, rtol=0)
    first, mid = causal_conv1d(x[:split], weight, zero)
    second, end = causal_conv1d(x[split:], weight, mid)
    torch.testing.assert_close(torch.cat([first, second]), y, atol=ATOL, rtol=0)
    torch.testing.assert_close(end, tail, atol=0, rtol=0)
    tails = conv_tails(x, zero, [0, split, seq])
    torch.testing.assert_close(tails[1], mid, atol=0, rtol=0)
    torch.testing.assert_close(tails[2], tail, atol=0, rtol=0)
    assert torch.equal(tails[0], zero)
