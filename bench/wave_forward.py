"""Benchmark: one stage's forward on a shared-prefix wave against a cold chunk, and where
the time goes (torch profiler).

The wave is what a stage computes in ``bench/peer_vllm.py``'s ``shared-cached`` case:
``--wave`` chunks of ``--chunk`` new tokens, each after the same ``--prefix`` cached tokens
(8 x 128 after 1,152 by default). ``wave`` reads that prefix from one set of blocks, as
requests that share a cached prefix do; ``wave-copied`` gives every sequence its own copy
of the prefix blocks (the same numbers, so the same work, but no two chunks share a context:
``model/attention.py``'s context runs cannot form); ``cold`` is one chunk of ``--cold`` new
tokens at position 0. All layers of the model in one StageModel (SmolLM2-135M by default,
``bench/forward.py``'s ``load_model``), the MKL vendor shim preloaded as the servers do,
``--threads`` torch threads. Cases (and with ``--matmul both`` both matmuls) run
interleaved, each to its median over ``--runs``; tokens/s counts the new tokens, from the
calling thread's CPU time (the one that stays comparable on a shared machine) and from
wall time. ``--profile N`` then profiles one more run of each case and prints its N
costliest ops by self time, and how much of the profiled wall time no op accounts for
(Python between ops, and the profiler's own cost).

``--kernels`` adds per-kernel rates on the same core, GFLOP/s from CPU time: the wave's
attention in one layer as the model runs it (``paged_attention``: the K/V write, the context
gather, both fused-kernel calls and the merge), torch's fused kernel alone on the wave's
context part (its queries over the cached prefix, no gather), and the model's MLP
up-projection as a matmul (``tensor_ops.linear``, the wave's rows): the GEMM rate of this core
and dtype, the most an attention built on the same GEMMs could reach. Attention FLOPs count
QK^T and PV, 4 x heads x head_dim per (query, key) pair a query sees (causal: itself and
the keys before it).

    python bench/wave_forward.py --json out/wave.json --dtype bfloat16 [--matmul both]
        [--profile 15] [--kernels]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from forward import load_model, use_mkl_shim  # bench/ is on sys.path: this runs as a script

from prefill_node.model.attention import AttentionPlan, paged_attention
from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.partition import LayerRange
from prefill_node.model.stage_model import StageModel
from prefill_node.model.tensor_ops import linear, set_onednn_matmul

BLOCK = 16


def build_cases(
    model: StageModel, args: argparse.Namespace
) -> dict[str, Callable[[], torch.Tensor]]:
    """Each case as a closure running one forward; the prefixes are computed here."""
    config, dtype = model.config, model.dtype
    pre_blocks, own_blocks = -(-args.prefix // BLOCK), -(-args.chunk // BLOCK)
    cold_blocks = -(-args.cold // BLOCK)
    total = (1 + args.wave) * pre_blocks + 2 * args.wave * own_blocks + cold_blocks
    kv = stage_cache(config, model.layer_range, total, BLOCK, dtype)
    g = torch.Generator().manual_seed(0)
    ids = iter(range(total))

    def take(n: int) -> tuple[int, ...]:
        return tuple(next(ids) for _ in range(n))

    prefix_tokens = torch.randint(0, config.vocab_size, (args.prefix,), generator=g)
    shared = take(pre_blocks)
    copies = [take(pre_blocks) for _ in range(args.wave)]
    model(prefix_tokens, ChunkBatch((ChunkSpec(0, args.prefix, shared),)), kv)
    for copy in copies:
        for src, dst in zip(shared, copy, strict=True):
            kv.copy_block(src, dst)

    def wave(prefixes: list[tuple[int, ...]]) -> ChunkBatch:
        return ChunkBatch(
            tuple(ChunkSpec(args.prefix, args.chunk, p + take(own_blocks)) for p in prefixes)
        )

    batches = {
        "wave": wave([shared] * args.wave),
        "wave-copied": wave(copies),
        "cold": ChunkBatch((ChunkSpec(0, args.cold, take(cold_blocks)),)),
    }
    cases = {}
    for name, batch in batches.items():
        tokens = torch.randint(0, config.vocab_size, (batch.total_tokens,), generator=g)
        cases[name] = lambda tokens=tokens, batch=batch: model(tokens, batch, kv)
    return cases


def kernel_rows(model: StageModel, args: argparse.Namespace) -> list[dict]:
    """The ``--kernels`` rows: GFLOP/s of the wave's attention (as the model runs it, and the
    fused kernel alone on its context part) and of the MLP up-projection, medians of
    ``--runs`` from the calling thread's CPU time."""
    config, dtype = model.config, model.dtype
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    rows_n, prefix = args.wave * args.chunk, args.prefix
    pre_blocks, own_blocks = -(-prefix // BLOCK), -(-args.chunk // BLOCK)
    kv = stage_cache(config, LayerRange(0, 1), pre_blocks + args.wave * own_blocks, BLOCK, dtype)
    g = torch.Generator().manual_seed(1)
    shared = tuple(range(pre_blocks))
    own = iter(range(pre_blocks, pre_blocks + args.wave * own_blocks))
    pk, pv = (torch.randn(prefix, kv_heads, d, generator=g).to(dtype) for _ in "kv")
    pre_plan = AttentionPlan.build(ChunkBatch((ChunkSpec(0, prefix, shared),)), kv, dtype)
    kv.write_slots(0, pre_plan.k_slots, pk, pv)
    specs = [
        ChunkSpec(prefix, args.chunk, shared + tuple(next(own) for _ in range(own_blocks)))
        for _ in range(args.wave)
    ]
    batch = ChunkBatch(tuple(specs))
    plan = AttentionPlan.build(batch, kv, dtype)
    q = torch.randn(rows_n, heads, d, generator=g).to(dtype)
    k, v = (torch.randn(rows_n, kv_heads, d, generator=g).to(dtype) for _ in "kv")
    group = heads // kv_heads
    grouped_q = q.transpose(0, 1).unflatten(0, (kv_heads, group))
    ctx_k, ctx_v = (t.transpose(0, 1).unsqueeze(1).expand(-1, group, -1, -1) for t in (pk, pv))
    x = torch.randn(rows_n, config.hidden_size, generator=g).to(dtype)
    w = torch.nn.Parameter(
        torch.randn(config.intermediate_size, config.hidden_size, generator=g).to(dtype),
        requires_grad=False,
    )
    pairs_ctx = rows_n * prefix
    pairs_own = args.wave * args.chunk * (args.chunk + 1) // 2
    kernels = {
        "attention-wave": (
            lambda: paged_attention(q, k, v, plan, kv, 0),
            4 * heads * d * (pairs_ctx + pairs_own),
        ),
        "attention-context-fused": (
            lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                grouped_q, ctx_k, ctx_v, 0.0, False
            ),
            4 * heads * d * pairs_ctx,
        ),
        "gemm-mlp-up": (lambda: linear(x, w), 2 * rows_n * config.hidden_size * w.shape[0]),
    }
    out = []
    for name, (fn, flops) in kernels.items():
        fn()  # warm-up
        cpu = []
        for _ in range(args.runs):
            c0 = time.thread_time()
            fn()
            cpu.append(time.thread_time() - c0)
        t = statistics.median(cpu)
        out.append(
            {"case": name, "dtype": args.dtype, "threads": args.threads, "runs": args.runs,
             "gflop": round(flops / 1e9, 3), "cpu_ms": round(t * 1e3, 2),
             "gflops": round(flops / t / 1e9, 1)}
        )  # fmt: skip
    gemm = out[-1]["gflops"]
    print(f"\nkernels, one layer, medians of {args.runs} runs (CPU time)")
    print(f"{'kernel':<24} {'GFLOP':>7} {'ms':>8} {'GFLOP/s':>8} {'of GEMM':>8}")
    for r in out:
        r["share_of_gemm"] = round(r["gflops"] / gemm, 3)
        print(
            f"{r['case']:<24} {r['gflop']:>7.3f} {r['cpu_ms']:>8.2f} {r['gflops']:>8.1f} "
            f"{r['share_of_gemm']:>8.2f}"
        )
    return out


def profile(name: str, run: Callable[[], torch.Tensor], rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        wall_ms = (time.perf_counter() - t0) * 1e3
    ops = prof.key_averages()
    in_ops_ms = sum(e.self_cpu_time_total for e in ops) / 1e3
    print(
        f"\n{name}: profiled wall {wall_ms:.0f} ms, in ops {in_ops_ms:.0f} ms, "
        f"outside any op {wall_ms - in_ops_ms:.0f} ms"
    )
    print(f"{'op':<52} {'self ms':>8} {'share':>6} {'calls':>6}")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:rows]:
        ms = e.self_cpu_time_total / 1e3
        print(f"{e.key[:52]:<52} {ms:>8.1f} {ms / wall_ms:>6.1%} {e.count:>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="write the rows here")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per case (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wave", type=int, default=8, help="chunks in the wave")
    ap.add_argument("--chunk", type=int, default=128, help="new tokens per wave chunk")
    ap.add_argument("--prefix", type=int, default=1152, help="cached tokens before each")
    ap.add_argument("--cold", type=int, default=1024, help="tokens of the cold chunk")
    ap.add_argument("--matmul", choices=["onednn", "f-linear", "both"], default="onednn")
    ap.add_argument("--random-weights", action="store_true", help="skip the real default model")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="top N ops per case")
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also rate the wave's attention, the fused kernel alone and a GEMM (GFLOP/s)",
    )
    args = ap.parse_args()
    use_mkl_shim(True)  # may restart this process
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config, weights, source = load_model("llama", args.random_weights)
    model = StageModel(config, LayerRange(0, config.num_layers), dtype)
    model.load_weights(weights)
    del weights
    cases = build_cases(model, args)
    matmuls = ["onednn", "f-linear"] if args.matmul == "both" else [args.matmul]
    cells = [(c, m) for c in cases for m in matmuls]
    print(f"model: {config.name} ({source}), {args.dtype}, {args.threads} thread(s)")

    def run(cell: tuple[str, str]) -> tuple[float, float]:
        set_onednn_matmul(cell[1] == "onednn")
        t0, c0 = time.perf_counter(), time.thread_time()
        cases[cell[0]]()
        return time.perf_counter() - t0, time.thread_time() - c0

    for cell in cells:
        run(cell)  # warm-up: packing, kernel compilation
    times: dict[tuple[str, str], list[tuple[float, float]]] = {cell: [] for cell in cells}
    for r in range(args.runs):
        for cell in cells if r % 2 == 0 else cells[::-1]:  # background load drifts
            times[cell].append(run(cell))
    print(f"\nmedians of {args.runs} runs, new tokens per second")
    print(f"{'case':<12} {'matmul':<9} {'tokens':>6} {'cpu tok/s':>10} {'wall tok/s':>11}")
    rows = []
    for (name, matmul), ts in times.items():
        tokens = args.cold if name == "cold" else args.wave * args.chunk
        wall, cpu = (statistics.median(t[i] for t in ts) for i in (0, 1))
        print(f"{name:<12} {matmul:<9} {tokens:>6} {tokens / cpu:>10.0f} {tokens / wall:>11.0f}")
        rows.append(
            {"case": name, "matmul": matmul, "dtype": args.dtype, "threads": args.threads,
             "tokens": tokens, "runs": args.runs, "cpu_tok_s": round(tokens / cpu, 1),
             "wall_tok_s": round(tokens / wall, 1)}
        )  # fmt: skip
    if args.kernels:
        set_onednn_matmul(matmuls[0] == "onednn")
        rows += kernel_rows(model, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    for name, matmul in cells if args.profile else ():
        set_onednn_matmul(matmul == "onednn")
        profile(f"{name} ({matmul})", cases[name], args.profile)


if __name__ == "__main__":
    main()
