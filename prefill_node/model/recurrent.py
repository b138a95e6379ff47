"""The recurrent math of linear-attention layers: the gated delta rule and the short causal conv.

Shared by every family with a recurrent state (Qwen3-Next's GatedDeltaNet, per-head decay;
Kimi Linear's KDA, per-key-channel decay). One sequence at a time, no batch dimension; the
delta rule computes in fp64 for fp32 inputs (see ``gated_delta_rule_states``) and in fp32
for lower precisions, and keeps its state in fp32.

The delta rule runs in chunks (the UT-transform form of transformers' torch reference): chunk
boundaries fall on every requested offset, so the state after any prefix the caller asks for
(a block boundary, for snapshots) is a by-product of the scan, not a recomputation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefill_node.errors import InvariantError

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim: how both families normalise q and k
    before the delta rule (in fp32)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the gated delta rule; returns (out [T, H, Dv], final state).

    q, k: [T, H, Dk], already L2-normalised (``l2_normalize``); the 1/sqrt(Dk) query scale is
    applied here. v: [T, H, Dv]. beta: [T, H]. g: log-decay (<= 0), [T, H] (one per head,
    Qwen3-Next) or [T, H, Dk] (one per key channel, KDA). state: [H, Dk, Dv], zeros for a
    fresh sequence. Per token: S = exp(g) S; S += k (beta (v - S^T k))^T; out = S^T q.
    """
    out, states = gated_delta_rule_states(q, k, v, g, beta, state, (q.shape[0],))
    return out, states[0]


def gated_delta_rule_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    offsets: Sequence[int],
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` that also returns the state after each of ``offsets`` tokens:
    (out [T, H, Dv] in q's dtype, states [len(offsets), H, Dk, Dv] fp32); offset 0 is
    ``state`` itself, offset T the final state. Offsets must lie in [0, T]."""
    seq, heads, dk = _check(q, k, v, g, beta, state, offsets)
    dtype = q.dtype
    # fp32 models compute in fp64: the chunked form (triangular solves, exp of cumulative
    # decays) amplifies rounding, so in fp32 its result would depend on where a wave's chunks
    # start by more than 1e-4; lower-precision models compute in fp32
    work = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    s = state.to(work)
    q = q * dk**-0.5
    starts, lengths = _chunks(seq, offsets, chunk_size)
    if not starts:
        return v.to(dtype), s.unsqueeze(0).expand(len(offsets), -1, -1, -1).to(torch.float32)
    # pad every chunk to the longest one, not to chunk_size: offsets at every block boundary
    # cut a prompt into block-sized chunks, and the intra-chunk work grows with size^2
    chunk_size = max(lengths)
    idx = _gather_index(starts, lengths, chunk_size, seq, q.device)
    valid = idx < seq
    qc, kc, vc, gc, bc = (_chunked(t, idx) for t in (q, k, v, g, beta))
    # qc/kc [n, H, C, Dk], vc [n, H, C, Dv], bc [n, H, C], gc [n, H, C] or [n, H, C, Dk]
    cum = gc.cumsum(dim=2)
    per_channel = g.dim() == 3
    future = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    kb = kc * bc.unsqueeze(-1)
    vb = vc * bc.unsqueeze(-1)
    if per_channel:
        decay = cum.unsqueeze(3) - cum.unsqueeze(2)  # [n, H, C, C, Dk]
        decay = decay.masked_fill(future[..., None], float("-inf")).exp()
        ut = (kb.unsqueeze(3) * kc.unsqueeze(2) * decay).sum(-1)
        intra = (qc.unsqueeze(3) * kc.unsqueeze(2) * decay).sum(-1)
        last = cum[:, :, -1:, :]  # [n, H, 1, Dk]
        cum_e = cum
    else:
        decay = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(future, float("-inf")).exp()
        ut = (kb @ kc.transpose(-1, -2)) * decay
        intra = (qc @ kc.transpose(-1, -2)) * decay
        last = cum[:, :, -1:].unsqueeze(-1)  # [n, H, 1, 1]
        cum_e = cum.unsqueeze(-1)
    # (I + strictly-lower(ut))^-1 condenses a chunk's delta-rule updates into matmuls
    u = torch.linalg.solve_triangular(ut, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, kb * cum_e.exp(), upper=False, unitriangular=True)
    q_dec = qc * cum_e.exp()
    k_dec = kc * (last - cum_e).exp()
    chunk_decay = last.exp().transpose(-1, -2)  # [n, H, Dk or 1, 1]
    outs = torch.empty_like(vc)
    wanted = set(offsets)
    after: dict[int, torch.Tensor] = {0: s}
    for i in range(len(starts)):
        v_new = u[i] - w[i] @ s
        outs[i] = q_dec[i] @ s + intra[i] @ v_new
        s = s * chunk_decay[i] + k_dec[i].transpose(-1, -2) @ v_new
        if starts[i] + lengths[i] in wanted:
            after[starts[i] + lengths[i]] = s
    out = outs.permute(0, 2, 1, 3).reshape(-1, heads, v.shape[-1])[valid.reshape(-1)]
    return out.to(dtype), torch.stack([after[o] for o in offsets]).to(torch.float32)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution continuing from ``tail``; returns (y [T, D], new tail).

    x: [T, D]; weight: [D, K] (HF ``conv1d.weight`` squeezed); tail: [K - 1, D], the inputs
    before x (zeros for a fresh sequence). y is before the activation (both families apply
    SiLU); new tail = the last K - 1 rows of tail ++ x, i.e. ``conv_tails(...)`` at T.
    """
    width, kernel = weight.shape
    if x.dim() != 2 or x.shape[1] != width or tuple(tail.shape) != (kernel - 1, width):
        raise InvariantError(
            f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"tail {tuple(tail.shape)} do not fit"
        )
    full = torch.cat([tail.to(weight.dtype), x.to(weight.dtype)])
    if x.shape[0] == 0:
        return x.clone(), full.clone()
    y = F.conv1d(full.T.unsqueeze(0), weight.unsqueeze(1), groups=width)[0].T
    return y.to(x.dtype), full[full.shape[0] - (kernel - 1) :].clone()


def conv_tails(x: torch.Tensor, tail: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor:
    """The conv tail after each of ``offsets`` tokens of x: [len(offsets), K - 1, D]."""
    full = torch.cat([tail.to(x.dtype), x])
    width = tail.shape[0]
    if any(not 0 <= o <= x.shape[0] for o in offsets):
        raise InvariantError(f"conv tail offsets {list(offsets)} outside [0, {x.shape[0]}]")
    return torch.stack([full[o : o + width] for o in offsets])


def _check(q, k, v, g, beta, state, offsets) -> tuple[int, int, int]:
    seq, heads, dk = k.shape
    dv = v.shape[-1]
    shapes_ok = (
        tuple(q.shape) == (seq, heads, dk)
        and tuple(v.shape) == (seq, heads, dv)
        and tuple(beta.shape) == (seq, heads)
        and tuple(g.shape) in ((seq, heads), (seq, heads, dk))
        and tuple(state.shape) == (heads, dk, dv)
    )
    if not shapes_ok:
        raise InvariantError(
            "gated_delta_rule shapes: q "
            f"{tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
            f"beta {tuple(beta.shape)} state {tuple(state.shape)}"
        )
    if any(not 0 <= o <= seq for o in offsets):
        raise InvariantError(f"gated_delta_rule offsets {list(offsets)} outside [0, {seq}]")
    return seq, heads, dk


def _chunks(seq: int, offsets: Sequence[int], size: int) -> tuple[list[int], list[int]]:
    """Chunks of at most ``size`` tokens covering [0, seq), cut at every offset."""
    cuts = sorted({0, seq, *offsets})
    starts: list[int] = []
    lengths: list[int] = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        for start in range(a, b, size):
            starts.append(start)
            lengths.append(min(size, b - start))
    return starts, lengths


def _gather_index(
    starts: list[int], lengths: list[int], size: int, seq: int, device: torch.device
) -> torch.Tensor:
    """[n, size] token index per chunk slot; ``seq`` (a zero row) pads short chunks."""
    lane = torch.arange(size, device=device)
    start = torch.tensor(starts, device=device).unsqueeze(1)
    length = torch.tensor(lengths, device=device).unsqueeze(1)
    return torch.where(lane < length, start + lane, seq)


def _chunked(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[T, H, ...] -> [n, H, C, ...] by ``idx``; padded slots read zeros, which leave the
    state untouched (k = 0 writes nothing, g = 0 decays nothing)."""
    padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
    return padded[idx].transpose(1, 2)
