"""Benchmark: end-to-end prefill throughput with KV shipping ON (push to decode) vs OFF.

One engine (``--engine pipeline``, the default: the multi-process runtime, one OS process
per stage; ``--engine local``: the in-process LocalEngine; either way each stage owns its
NIXL agent) serves the same prompts twice per run: OFF (no ``kv_destination``: KV stays on
the prefill tier) and ON (push: every stage WRITEs its layers into blocks a reference
decode worker in another process allocated; the request completes only when every stage's
WRITE landed and was notified). Timed: each request's ``submit -> result`` (what a router
waits for), wall and this process's CPU time (local: the engine and hand-off threads;
pipeline: the leader process only, stage 0 with its hand-off thread; other stages and the
decode process are not counted). After each ON request the decode worker confirms the KV
arrived (outside the timed region).

Streamed vs at-end hand-off (``--kv-stream both``, the default): every run starts one
engine per ``KVHandoffConfig.stream`` setting, one after the other (the order alternating
run by run), each serving the same OFF / ON passes; the streamed / at-end throughput ratio
is the median of the runs' own ratios, so slow drift of the machine does not land on one
side. For every ON request, the tail: from its last chunk finishing on the last
stage (pipeline: the forward's end there, dated on the leader's clock as the result's arrival
less the stage's ``WaveResult.held_s``, so late by the result's transit; local: after the
last stage's logits) to its KV being complete on decode (when the decode process's receiver
saw every stage's "done"; it polls every ``--decode-poll-us`` while a reception is due to
end, every ``--decode-live-poll-us`` while it is live further from its end; one
monotonic clock on this host), and the engine's ``handoff_s`` (the same start -> every
stage's WRITE confirmed, as each stage reports it to the leader). Default prompts span 16
chunks (1024 tokens, chunk budget 64). One chunk's transfer time is measured, not derived:
each at-end engine also prefills one-chunk prompts (the first ``--max-chunk-tokens`` of
each), whose tail is that chunk's KV moved on its own, post and notification included
(``chunk_transfer_ms``; ``chunk_transfer_ms_est`` divides the whole prompt's at-end tail
by its chunks instead, which spreads those fixed costs thin). Goals: streamed tail <= one
chunk's transfer time; streamed ON throughput / at-end ON throughput >= 0.95. Streamed, each
stage ships its last chunk layer group by layer group during that chunk's forward
(``--layer-groups``, default ``KVHandoffConfig.stream_layer_groups``; 1: the whole last
chunk after the forward), so the tail moves only the last group's layers of it.

Prompts are random token ids; each pass replaces token 0 with a per-pass salt so no pass
hits the prefix cache of an earlier one (same compute in every pass). One untimed warm-up
pass per engine start and mode (NIXL connects on the first push). Median of
``--runs`` runs; ratio = ON / OFF throughput (goal >= 0.95: shipping hides behind compute).

    PYTHONPATH=. python bench/kv_shipping.py --json out/kv_shipping.json [--runs 3]
        [--prompts 6] [--tokens 1024] [--max-chunk-tokens 64] [--kv-stream both|on|off]
        [--model DIR] [--threads 1] [--engine pipeline|local] [--decode-poll-us 200]
        [--decode-live-poll-us 2000]
        [--layer-groups N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from prefill_node.decode.worker_process import BUSY_POLL_S, LIVE_POLL_S


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True, help="write the rows here")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: built-in SmolLM2)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument(
        "--engine",
        choices=("pipeline", "local"),
        default="pipeline",
        help="multi-process pipeline (default) or the in-process LocalEngine",
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs per mode (median)")
    p.add_argument("--prompts", type=int, default=6, help="prompts per pass")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-chunk-tokens", type=int, default=64, help="chunk (wave) budget")
    p.add_argument(
        "--kv-stream",
        choices=("both", "on", "off"),
        default="both",
        help="push streamed per chunk (on), at the end (off) or both, one engine each",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--layer-groups",
        type=int,
        default=None,
        help="streamed: layer groups of the last chunk per stage (default: the config's)",
    )
    p.add_argument(
        "--decode-poll-us",
        type=float,
        default=1e6 * BUSY_POLL_S,
        help="the decode worker's receiver poll period while a reception is due to end",
    )
    p.add_argument(
        "--decode-live-poll-us",
        type=float,
        default=1e6 * LIVE_POLL_S,
        help="its poll period while a streamed reception is live, further from its end",
    )
    args = p.parse_args()
    if args.runs < 3:
        p.error("--runs must be >= 3 (median of at least three)")
    return args


class Bench:
    """The engine, the decode worker and the prompts; ``run_pass`` times one pass."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, decode, stream: bool) -> None:
        from prefill_node.kv_handoff.config import KVHandoffConfig
        from prefill_node.runtime.engine_config import EngineConfig
        from prefill_node.runtime.factory import build_engine

        blocks_per_prompt = -(-args.tokens // args.block_size)
        self.decode = decode
        handoff = KVHandoffConfig(stream=stream)
        if args.layer_groups is not None:
            handoff = replace(handoff, stream_layer_groups=args.layer_groups)
        self.layer_groups = handoff.stream_layer_groups if stream else 1
        config = EngineConfig(
            model_dir=model_dir,
            stages=args.stages,
            num_blocks=blocks_per_prompt * 4,
            block_size=args.block_size,
            max_wave_tokens=args.max_chunk_tokens,
            kv_handoff=handoff,
        )
        self.engine = build_engine(config, args.engine)
        rng = random.Random(0)
        vocab = self.engine.vocab_size
        self.prompts = [
            [rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(args.prompts)
        ]
        self._salts = iter(range(1, vocab))

    def run_pass(
        self, ship: bool, progress: tqdm, tokens: int | None = None
    ) -> tuple[float, float, list, list]:
        """Prefill every prompt once (its first ``tokens`` only, if given): (wall seconds,
        CPU seconds) summed over the requests, and per ON request its tail (last chunk done
        -> KV complete on decode) and ``handoff_s``."""
        from prefill_node.engine.types import PrefillOptions

        salt = next(self._salts)
        wall = cpu = 0.0
        logits_at: dict[str, float] = {}
        handoff: list[float] = []
        for base in (p[:tokens] for p in self.prompts):
            prompt = [salt, *base[1:]]
            request_id = uuid.uuid4().hex[:12]
            dest = self.decode.expect_push(request_id, prompt) if ship else None
            w0, c0, m0 = time.perf_counter(), time.process_time(), time.monotonic()
            result = self.engine.submit(prompt, PrefillOptions(request_id, kv_destination=dest))
            result = result.result()
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
            if result.computed_tokens != len(prompt):
                raise RuntimeError(f"pass hit the prefix cache ({result.cached_tokens} cached)")
            if ship:  # the KV really arrived: decode yields the first token only after it did
                t = result.timings
                # the last chunk's end (m0 <= the engine's t_submit: a lower bound)
                logits_at[request_id] = m0 + t.total_s - t.handoff_s
                handoff.append(t.handoff_s)
                list(self.decode.generate(request_id, result.first_token_id, 1))
                self.decode.release(request_id)
            progress.update(1)
        tails = []
        if logits_at:
            _, ready_at = self.decode.kv_log()
            tails = [ready_at[rid] - at for rid, at in logits_at.items()]
        return wall, cpu, tails, handoff

    def close(self) -> None:
        self.engine.shutdown()


def run_engines(args, model_dir: Path, decode, streams: tuple[bool, ...], bar: tqdm) -> list[dict]:
    """Per run, one engine per ``stream`` setting, one after the other (their order
    alternating run by run; one process can lead one pipeline at a time), each started
    afresh: a warm-up pass per mode, then an OFF and an ON pass in alternating order. Each
    run's engines thus run close together, and its streamed / at-end ratio pairs them. One
    row per timed pass."""
    rows = []
    tokens = args.prompts * args.tokens
    for run in range(args.runs):
        for stream in streams if run % 2 == 0 else streams[::-1]:
            bench = Bench(args, model_dir, decode, stream)
            try:
                bench.run_pass(False, bar)  # warm-up (untimed)
                bench.run_pass(True, bar)
                for ship in (False, True) if run % 2 == 0 else (True, False):
                    wall, cpu, tails, handoff = bench.run_pass(ship, bar)
                    rows.append(
                        {
                            "mode": "shipping_on" if ship else "shipping_off",
                            "kv_stream": "on" if stream else "off",
                            "engine": args.engine,
                            "run": run,
                            "stages": args.stages,
                            "prompts": args.prompts,
                            "prompt_tokens": args.tokens,
                            "chunks_per_prompt": -(-args.tokens // args.max_chunk_tokens),
                            "wall_s": round(wall, 4),
                            "cpu_s": round(cpu, 4),
                            "tok_per_s": round(tokens / wall, 1),
                            "tail_ms_median": _ms(tails),
                            "handoff_ms_median": _ms(handoff),
                            "decode_poll_us": args.decode_poll_us,
                            "decode_live_poll_us": args.decode_live_poll_us,
                            "layer_groups": bench.layer_groups,
                        }
                    )
                if not stream:  # one chunk's KV, measured: a one-chunk prompt's at-end tail
                    _, _, tails, _ = bench.run_pass(True, bar, args.max_chunk_tokens)
                    rows.append(
                        {
                            "mode": "one_chunk",
                            "kv_stream": "off",
                            "engine": args.engine,
                            "run": run,
                            "prompt_tokens": args.max_chunk_tokens,
                            "tail_ms_median": _ms(tails),
                        }
                    )
            finally:
                bench.close()
    return rows


def _ms(values: list[float]) -> float | None:
    return round(1000 * statistics.median(values), 3) if values else None


def summarise(rows: list[dict], stream: str, runs: int) -> dict:
    mine = {m: [r for r in rows if r["mode"] == m] for m in ("shipping_off", "shipping_on")}
    off = statistics.median(r["tok_per_s"] for r in mine["shipping_off"])
    on = statistics.median(r["tok_per_s"] for r in mine["shipping_on"])
    cpu_off = statistics.median(r["cpu_s"] for r in mine["shipping_off"])
    cpu_on = statistics.median(r["cpu_s"] for r in mine["shipping_on"])
    return {
        "mode": "summary",
        "kv_stream": stream,
        "engine": rows[0]["engine"],
        "off_tok_per_s": off,
        "on_tok_per_s": on,
        "ratio_on_over_off": round(on / off, 4),
        "cpu_ratio_on_over_off": round(cpu_on / cpu_off, 4),
        "tail_ms_median": statistics.median(r["tail_ms_median"] for r in mine["shipping_on"]),
        "handoff_ms_median": statistics.median(r["handoff_ms_median"] for r in mine["shipping_on"]),
        "decode_poll_us": rows[0]["decode_poll_us"],
        "decode_live_poll_us": rows[0]["decode_live_poll_us"],
        "layer_groups": rows[0]["layer_groups"],
        "runs": runs,
    }


def main() -> None:
    import torch

    from prefill_node.decode.worker_process import DecodeWorkerProcess, DecodeWorkerSpec

    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from prefill_node.model.default_model import default_model_dir

        model_dir = default_model_dir()
    streams = {"both": (False, True), "on": (True,), "off": (False,)}[args.kv_stream]
    decode = DecodeWorkerProcess(
        DecodeWorkerSpec(
            model_dir=str(model_dir),
            num_blocks=-(-args.tokens // args.block_size) + 4,
            block_size=args.block_size,
            busy_poll_s=args.decode_poll_us / 1e6,
            live_poll_s=max(args.decode_poll_us, args.decode_live_poll_us) / 1e6,
        )
    )
    rows: list[dict] = []
    summaries: list[dict] = []
    # warm-up + timed, OFF and ON; at-end engines also a one-chunk pass
    total = (len(streams) * 4 + (False in streams)) * args.runs * args.prompts
    try:
        with tqdm(total=total, desc="prefill passes") as bar:
            rows = run_engines(args, model_dir, decode, streams, bar)
    finally:
        decode.stop()
    for stream in streams:
        label = "on" if stream else "off"
        summaries.append(summarise([r for r in rows if r["kv_stream"] == label], label, args.runs))
    if len(summaries) == 2:  # streamed vs at-end, side by side
        at_end, streamed = summaries
        on = {
            (r["kv_stream"], r["run"]): r["tok_per_s"] for r in rows if r["mode"] == "shipping_on"
        }
        paired = [on["on", run] / on["off", run] for run in range(args.runs)]
        summaries.append(
            {
                "mode": "stream_vs_at_end",
                "engine": args.engine,
                # median of each run's own streamed / at-end ratio (passes interleaved)
                "on_tok_per_s_ratio": round(statistics.median(paired), 4),
                "tail_ms_at_end": at_end["tail_ms_median"],
                "tail_ms_streamed": streamed["tail_ms_median"],
                "tail_ratio": round(streamed["tail_ms_median"] / at_end["tail_ms_median"], 4),
                # the at-end tail moves a whole prompt's KV: per chunk, its share
                "chunk_transfer_ms_est": round(
                    at_end["tail_ms_median"] / -(-args.tokens // args.max_chunk_tokens), 3
                ),
                # one chunk's KV moved on its own (fixed costs included): median over runs
                "chunk_transfer_ms": statistics.median(
                    r["tail_ms_median"] for r in rows if r["mode"] == "one_chunk"
                ),
            }
        )
    print(
        f"\n{'mode':<14}{'stream':>7}{'run':>4}{'wall s':>9}{'cpu s':>9}{'tok/s':>10}{'tail ms':>9}"
    )
    for r in rows:
        tail = r["tail_ms_median"]
        timed = (
            f"{r['wall_s']:>9.3f}{r['cpu_s']:>9.3f}{r['tok_per_s']:>10.1f}"
            if "wall_s" in r
            else f"{'':>28}"
        )
        print(
            f"{r['mode']:<14}{r['kv_stream']:>7}{r['run']:>4}{timed}"
            f"{'' if tail is None else f'{tail:9.2f}'}"
        )
    for sm in summaries:
        print(json.dumps(sm))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows + summaries, indent=1))


if __name__ == "__main__":
    main()
