"""Benchmark: one stage's forward (all layers) vs transformers' forward, tokens per second.

Both sides compute a chunk of ``chunk`` new tokens after ``context`` cached tokens, store
the chunk's KV, and produce the last token's logits: ours with a paged cache already holding
the context (``StageModel.forward`` + ``compute_logits`` on the last row), transformers with
a ``DynamicCache`` prefilled to the context (a fresh copy per run, copied outside the timing)
and ``logits_to_keep=1``. Same model, same weights, same thread count; runs of the two sides
are interleaved so background load hits both alike. ``--family llama`` (default) is
SmolLM2-135M (converted real weights when ``prefill_node.model.default_model`` can provide
them, else random weights with its config; the output says which); ``--family minimax-m2``
is a small random MiniMax-M2-class MoE and ``--family glm-5`` a small random GLM-5-class
model (MLA + sparse-attention indexer keeping 256 positions + MoE with a shared expert),
``--family qwen3-next`` a small random Qwen3-Next-class hybrid (gated-delta-rule linear
attention in 3 of every 4 layers, the context resumed from the cache's block snapshot) and
``--family kimi-linear`` a small random Kimi-Linear-class hybrid (KDA in 3 of every 4 layers,
MLA without RoPE or indexer in the rest, grouped MoE with a shared expert);
transformers loads those from a checkpoint directory written here. Each cell reports
tokens/s from the median wall-clock time and, because a shared machine's load swings wall
time by 2x, also from the median CPU time of the (single) compute thread. ``--matmul``
picks our fp32 and bf16 matmul: oneDNN on prepacked weights (the default,
``model/tensor_ops.linear``) or F.linear (what transformers runs: MKL for fp32 here, oneDNN
reordering the weight on every call for bf16) to see what the packing buys.

    python bench/forward.py --json /tmp/forward.json [--family minimax-m2] [--runs 3]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from prefill_node.mkl_vendor import SHIM_ENV, reexec_with_shim, without_shim
from prefill_node.model.attention import AttentionPath
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.config import ModelConfig, ModelFamily, MoeConfig
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.loader_hf import load_hf_config, load_hf_weights, save_hf_checkpoint
from prefill_node.model.partition import LayerRange
from prefill_node.model.stage_model import StageModel
from prefill_node.model.tensor_ops import set_onednn_matmul
from prefill_node.model.weights import random_weights

SMOLLM2_135M = ModelConfig(
    family=ModelFamily.LLAMA,
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    rope_scaling=None,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    name="SmolLM2-135M-random",
)


# MiniMax-M2's shape (GQA 6:1, partial RoPE over half a head, 8 of many narrow experts),
# shrunk so a CPU forward takes seconds.
MINIMAX_M2_SMALL = ModelConfig(
    family=ModelFamily.MINIMAX_M2,
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=128,
    num_layers=6,
    num_heads=12,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=5_000_000.0,
    rope_scaling=None,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    name="MiniMax-M2-small-random",
    moe=MoeConfig(num_experts=32, top_k=8, expert_intermediate_size=128),
    partial_rotary_factor=0.5,
)


# GLM-5's shape shrunk: MLA (q LoRA, KV latent, rope/nope/v split), an indexer keeping 256
# positions (so the 2048-token context is sparse), 1 dense layer then 32 experts (8 active)
# plus a shared one.
GLM5_SMALL = ModelConfig.from_hf_config(
    {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "vocab_size": 8192,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "n_shared_experts": 1,
        "n_routed_experts": 32,
        "routed_scaling_factor": 2.5,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 128,
        "q_lora_rank": 192,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "index_topk": 256,
        "index_head_dim": 64,
        "index_n_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 1_000_000.0,
    },
    name="GLM-5-small-random",
)
# Qwen3-Next's shape shrunk: 3 linear-attention layers (GatedDeltaNet, 4 q/k heads shared by
# 8 value heads) per gated full-attention layer, 32 experts (8 active) + a gated shared one.
QWEN3_NEXT_SMALL = ModelConfig.from_hf_config(
    {
        "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": 8192,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "num_experts": 32,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "max_position_embeddings": 8192,
        "rope_theta": 10_000_000.0,
    },
    name="Qwen3-Next-small-random",
)
# Kimi Linear's shape shrunk: KDA (6 heads of 64) in 3 of every 4 layers, MLA (no q LoRA, no
# RoPE) in the rest; 1 dense layer, then 32 experts (8 active) + a shared one.
KIMI_LINEAR_SMALL = ModelConfig.from_hf_config(
    {
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 8192,
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": None,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "mla_use_nope": True,
        "linear_attn_config": {
            "num_heads": 6,
            "head_dim": 64,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3, 5, 6, 7],
            "full_attn_layers": [4, 8],
        },
        "num_experts": 32,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 128,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446,
        "model_max_length": 8192,
    },
    name="Kimi-Linear-small-random",
)
SMALL_FAMILIES = {
    "minimax-m2": MINIMAX_M2_SMALL,
    "glm-5": GLM5_SMALL,
    "qwen3-next": QWEN3_NEXT_SMALL,
    "kimi-linear": KIMI_LINEAR_SMALL,
}


def load_model(family: str, force_random: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    if family in SMALL_FAMILIES:
        config = SMALL_FAMILIES[family]
        return config, random_weights(config, seed=0), "random weights"
    if not force_random:
        try:
            from prefill_node.model.default_model import default_model_dir

            path = default_model_dir()
            config = load_hf_config(path)
            full = LayerRange(0, config.num_layers)
            return config, load_hf_weights(path, full, config), f"real weights from {path}"
        except Exception as e:  # noqa: BLE001 - any failure falls back to random weights
            print(f"default model unavailable ({type(e).__name__}: {e}); using random weights")
    return SMOLLM2_135M, random_weights(SMOLLM2_135M, seed=0), "random weights (SmolLM2 config)"


def build_hf(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype):
    import transformers

    if config.moe is not None:  # per-expert checkpoint tensors: transformers fuses on load
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_checkpoint(tmp, config, weights)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="sdpa"
            )
        return model.eval().to(dtype)
    hf_cfg = transformers.AutoConfig.for_model(**config.to_hf_config())
    hf_cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    model.load_state_dict(weights, strict=False)
    return model.to(dtype)


class Cell:
    """One (chunk, context) cell: both sides prepared with the context already cached."""

    def __init__(self, ours: StageModel, hf, config: ModelConfig, chunk: int, context: int):
        self.ours, self.hf, self.chunk, self.context = ours, hf, chunk, context
        g = torch.Generator().manual_seed(chunk * 7919 + context)
        self.tokens = torch.randint(0, config.vocab_size, (context + chunk,), generator=g)
        block = 16
        blocks = -(-(context + chunk) // block)
        table = tuple(torch.randperm(blocks, generator=g).tolist())
        self.kv = stage_cache(config, ours.layer_range, blocks, block, ours.dtype)
        self.batch = ChunkBatch((ChunkSpec(context, chunk, table),))
        self.hf_cache = None
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``
        params = inspect.signature(hf.forward).parameters
        self.hf_cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if context:
            ours(self.tokens[:context], ChunkBatch((ChunkSpec(0, context, table),)), self.kv)
            with torch.inference_mode():
                out = hf(self.tokens[None, :context], use_cache=True, logits_to_keep=1)
            self.hf_cache = getattr(out, "cache", None) or out.past_key_values
        # a recurrent layer's chunk overwrites the snapshot it resumes from (the live state in
        # its partial first block): keep the context's snapshots to restore before each run
        snaps = getattr(self.kv, "recurrent", None)
        self.snapshots = [] if snaps is None else [*snaps.states, *snaps.tails]
        self.saved = [t.clone() for t in self.snapshots]

    def run_ours(self) -> tuple[Timing, torch.Tensor]:
        for t, saved in zip(self.snapshots, self.saved, strict=True):
            t.copy_(saved)
        t0, c0 = time.perf_counter(), time.thread_time()
        hidden = self.ours(self.tokens[self.context :], self.batch, self.kv)
        logits = self.ours.compute_logits(hidden[-1:])
        return Timing(time.perf_counter() - t0, time.thread_time() - c0), logits[0]

    def run_hf(self) -> tuple[Timing, torch.Tensor]:
        cache = copy.deepcopy(self.hf_cache) if self.hf_cache is not None else None
        kwargs = {self.hf_cache_kwarg: cache} if cache is not None else {}
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.inference_mode():
            out = self.hf(
                self.tokens[None, self.context :], use_cache=True, logits_to_keep=1, **kwargs
            )
        return Timing(time.perf_counter() - t0, time.thread_time() - c0), out.logits[0, -1].float()


class Timing(NamedTuple):
    """Wall-clock seconds, and CPU seconds of the calling thread (with one torch thread all
    compute runs there; CPU time is what stays comparable on a machine shared with others)."""

    wall_s: float
    cpu_s: float


def cell_row(chunk: int, context: int, ours: list[Timing], hf: list[Timing]) -> dict:
    def med(ts: list[Timing], field: str) -> float:
        return statistics.median(getattr(t, field) for t in ts)

    row: dict = {"chunk": chunk, "context": context, "runs": len(ours)}
    for field, tag in (("wall_s", ""), ("cpu_s", "_cpu")):
        ours_tps, hf_tps = chunk / med(ours, field), chunk / med(hf, field)
        row[f"ours{tag}_tokens_per_s"] = round(ours_tps, 2)
        row[f"hf{tag}_tokens_per_s"] = round(hf_tps, 2)
        row[f"ratio{tag}"] = round(ours_tps / hf_tps, 3)
    return row


def use_mkl_shim(on: bool) -> None:
    """Restart this process with the MKL vendor shim preloaded (``on``) or without it."""
    if on:
        reexec_with_shim()
        return
    if os.environ.get(SHIM_ENV) != "0":
        env = without_shim(dict(os.environ))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, type=Path, help="write the result rows here")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per side and cell (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 2048])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--family", choices=["llama", *SMALL_FAMILIES], default="llama")
    ap.add_argument("--random-weights", action="store_true", help="skip the real default model")
    ap.add_argument(
        "--matmul",
        choices=["onednn", "f-linear"],
        default="onednn",
        help="our fp32 and bf16 matmul: oneDNN on prepacked weights (default) or F.linear",
    )
    ap.add_argument(
        "--attention",
        choices=[p.value for p in AttentionPath],
        help="our GQA attention path (default: the device's, see model/attention.py)",
    )
    ap.add_argument(
        "--mkl-shim",
        choices=["on", "off"],
        default="on",
        help="run with MKL's vendor check answered 'Intel' on AMD CPUs, as wavepp does "
        "(prefill_node/mkl_vendor.py; both sides get it), or without",
    )
    args = ap.parse_args()
    use_mkl_shim(args.mkl_shim == "on")  # may restart this process
    set_onednn_matmul(args.matmul == "onednn")
    if args.runs < 3:
        ap.error("--runs must be >= 3 (the result is a median)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config, weights, source = load_model(args.family, args.random_weights)
    ours = StageModel(config, LayerRange(0, config.num_layers), dtype)
    ours.load_weights(weights)
    if args.attention is not None:
        ours.attention_path = AttentionPath(args.attention)
    hf = build_hf(config, weights, dtype)
    del weights
    print(
        f"model: {config.name} ({source}), {args.dtype}, {args.threads} thread(s), "
        f"attention {ours.attention_path.value}"
    )

    rows = []
    cells = [(c, x) for x in args.contexts for c in args.chunks]
    with tqdm(total=len(cells) * (args.runs + 1), desc="forward bench", unit="run") as bar:
        for chunk, context in cells:
            cell = Cell(ours, hf, config, chunk, context)
            cell.run_ours(), cell.run_hf()  # warm-up, not timed
            bar.update()
            ours_t, hf_t, max_diff = [], [], 0.0
            for run in range(args.runs):
                if run % 2:  # alternate who goes first: background load drifts
                    t_hf, hf_logits = cell.run_hf()
                    t_ours, ours_logits = cell.run_ours()
                else:
                    t_ours, ours_logits = cell.run_ours()
                    t_hf, hf_logits = cell.run_hf()
                ours_t.append(t_ours)
                hf_t.append(t_hf)
                max_diff = max(max_diff, (ours_logits - hf_logits).abs().max().item())
                bar.update()
            row = {
                "bench": "forward",
                "family": config.family.value,
                "model": config.name,
                "weights": "random" if "random" in source else "real",
                "dtype": args.dtype,
                "threads": args.threads,
                "matmul": args.matmul,
                "mkl_shim": args.mkl_shim,
                "attention": ours.attention_path.value,
                **cell_row(chunk, context, ours_t, hf_t),
                "max_abs_logit_diff": max_diff,
            }
            rows.append(row)
            del cell

    print(f"\nmedians of {args.runs} runs; wall = elapsed time, cpu = this thread's CPU time")
    print(
        f"{'chunk':>6} {'context':>8} {'ours tok/s':>11} {'HF tok/s':>10} {'ratio':>7}"
        f" {'ours cpu':>9} {'HF cpu':>8} {'ratio cpu':>9}"
    )
    for r in rows:
        print(
            f"{r['chunk']:>6} {r['context']:>8} {r['ours_tokens_per_s']:>11.1f} "
            f"{r['hf_tokens_per_s']:>10.1f} {r['ratio']:>6.2f}x {r['ours_cpu_tokens_per_s']:>9.1f} "
            f"{r['hf_cpu_tokens_per_s']:>8.1f} {r['ratio_cpu']:>8.2f}x"
            f"   (logit diff {r['max_abs_logit_diff']:.1e})"
        )
    args.json.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {len(rows)} rows to {args.json}")


if __name__ == "__main__":
    main()
