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

    python bench/wave_forward.py --json out/wave.json --dtype bfloat16 [--matmul both]
        [--profile 15]
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

from prefill_node.model.batch import ChunkBatch, ChunkSpec
from prefill_node.model.latent_cache import stage_cache
from prefill_node.model.partition import LayerRange
from prefill_node.model.stage_model import StageModel
from prefill_node.model.tensor_ops import set_onednn_matmul

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
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    for name, matmul in cells if args.profile else ():
        set_onednn_matmul(matmul == "onednn")
        profile(f"{name} ({matmul})", cases[name], args.profile)


if __name__ == "__main__":
    main()
