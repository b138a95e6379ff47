"""Engine-level checks shared by the hybrid families' tests (Qwen3-Next, Kimi Linear): prefix
reuse through the admission core stops at a snapshot boundary, and eviction shrinks the
reused prefix without ever resuming from a wrong state. ``want_logits(prompt)``: the
transformers model's last-token logits for ``prompt``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from prefill_node.engine.types import PrefillOptions
from prefill_node.runtime.engine_config import EngineConfig
from prefill_node.runtime.local_engine import LocalEngine

WantLogits = Callable[[list[int]], torch.Tensor]


def check_reuse_up_to_a_snapshot(
    config, weights, tokens: Sequence[int], block: int, want_logits: WantLogits, atol: float
) -> None:
    """2 stages, 20-token chunks (ends fall mid-block): a prompt sharing 36 tokens reuses 4
    blocks (the snapshot boundary at 32); a wholly cached prompt of 40 reuses
    (40 - 1) // 8 = 4 blocks, never a block without its last token."""
    engine_config = EngineConfig(stages=2, num_blocks=32, block_size=block, max_wave_tokens=20)
    engine = LocalEngine.from_weights(config, weights, engine_config)
    prompts = [list(tokens[:40]), list(tokens[:36]) + list(tokens[60:70]), list(tokens[:40])]
    outs = [engine.prefill(p, PrefillOptions()) for p in prompts]
    assert [o.result.cached_tokens for o in outs] == [0, 32, 32]
    for prompt, out in zip(prompts, outs, strict=True):
        torch.testing.assert_close(out.logits, want_logits(prompt), atol=atol, rtol=0)
    engine.check_integrity()


def check_eviction_shrinks_reuse(
    config, weights, tokens: Sequence[int], block: int, want_logits: WantLogits, atol: float
) -> None:
    """A 7-block stage cache: a second prompt evicts the tail of the first one's chain, so
    repeating the first reuses only its leading blocks (their snapshots came with them)."""
    engine_config = EngineConfig(stages=2, num_blocks=7, block_size=block, max_wave_tokens=16)
    engine = LocalEngine.from_weights(config, weights, engine_config)
    first, other = list(tokens[:40]), list(tokens[30:70])
    outs = [engine.prefill(p, PrefillOptions()) for p in (first, other, first)]
    cached = outs[2].result.cached_tokens
    assert 0 < cached < 32 and cached % block == 0, cached
    for prompt, out in zip((first, other, first), outs, strict=True):
        torch.testing.assert_close(out.logits, want_logits(prompt), atol=atol, rtol=0)
    engine.check_integrity()
