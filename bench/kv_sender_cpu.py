"""Micro-benchmark: the CPU a streamed request's WRITEs cost the sending stage's thread,
prepared descriptor lists vs the general path, side by side in one run.

One KVSender (this process, the stage's layers; NIXL progress EVENT as on a stage) per path,
over clones of one KV pool; a KVReceiver in a spawned process (decode, polling every 200 us
while busy, as the reference decode worker). Each request goes as a stage streams it: one
all-layer range per chunk but the last, the last chunk's layer groups but the last
(``KVHandoffConfig.layer_group_ends``), then the final push; after handing each range over
the thread polls until it landed (as the hand-off thread would between chunks), sleeping
``--poll-us`` between polls. Measured with the thread's CPU clock, per request: all sender
calls (``stream`` / ``push`` / ``poll``, polls included), and per WRITE: building the
request (``_start`` without the post) and the post itself (``transfer``: the bytes are
copied there on one host). Paths alternate request by request; medians over ``--runs``
runs of ``--requests`` requests. A prompt a whole number of blocks long, decode blocks of
prefill's size: every WRITE is prepared when the path is on (``prepared_posted`` says).

    PYTHONPATH=. python bench/kv_sender_cpu.py --json out/kv_sender_cpu.json [--runs 5]
        [--requests 8] [--tokens 1024] [--chunk 64] [--layers 15] [--block-size 16]
        [--decode-block-size 16]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch
from nixl_throughput import call, decode_main

HEADS, HEAD_DIM = 3, 64  # SmolLM2-135M's KV heads (what bench/kv_handoff.py serves)


class Timed:
    """Thread-CPU seconds spent in ``sender._start`` and in its agent's ``transfer``."""

    def __init__(self, sender) -> None:
        self.start_s = self.post_s = 0.0
        sender._start = self._counted(sender._start, "start_s")
        sender.agent.nixl.transfer = self._counted(sender.agent.nixl.transfer, "post_s")

    def _counted(self, fn, total: str):
        """``fn``, adding the thread-CPU seconds of each call to ``self.<total>``."""

        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, total, getattr(self, total) + time.thread_time() - t)

        return timed


def one_request(sender, conn, args, request_id: str, src: tuple[int, ...], groups) -> float:
    """Ship one request as a stage streams it; the sender calls' thread-CPU seconds."""
    from kv_transfer.messages import PushDestination

    dest = PushDestination.from_dict(call(conn, "expect", request_id, args.tokens))
    cpu = 0.0

    def timed(fn, *a):
        nonlocal cpu
        t = time.thread_time()
        out = fn(*a)
        cpu += time.thread_time() - t
        return out

    def settle() -> None:  # poll until nothing streamed is in flight
        while timed(lambda: sender.parts_inflight):
            time.sleep(args.poll_us / 1e6)
            timed(sender.poll)

    last = args.tokens - args.chunk
    for start in range(0, last, args.chunk):
        timed(sender.stream, dest, src, start, start + args.chunk)
        timed(sender.poll)
        settle()
    lo = 0
    for hi in groups:
        timed(sender.stream, dest, src, last, args.tokens, (lo, hi))
        timed(sender.poll)
        settle()
        lo = hi
    timed(sender.push, dest, src, args.tokens, last, lo)
    done = None
    while done is None:
        outcomes = timed(sender.poll)
        done = next((o for o in outcomes if o.request_id == request_id), None)
        if done is None:
            time.sleep(args.poll_us / 1e6)
    if not done.ok or not call(conn, "finish", request_id, dest.block_ids):
        raise RuntimeError(f"{request_id} did not land: {done.error}")
    return cpu


def main() -> None:
    from kv_transfer.agent import KVAgent
    from kv_transfer.allowlist import AllowList
    from kv_transfer.progress import KVProgress
    from kv_transfer.sender import KVSender, SenderConfig
    from prefill_node.kv_handoff.config import KVHandoffConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the rows (a list of dicts) here")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--requests", type=int, default=8, help="requests per path per run")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--layers", type=int, default=15, help="the stage's layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-block-size", type=int, default=16)
    p.add_argument("--poll-us", type=float, default=500.0, help="the hand-off thread's pause")
    args = p.parse_args()
    if args.runs < 3:
        p.error("--runs must be >= 3 (medians)")
    blocks = -(-args.tokens // args.block_size)
    gen = torch.Generator().manual_seed(0)
    pool = [
        torch.randn(blocks * 2, 2, args.block_size, HEADS, HEAD_DIM, generator=gen)
        for _ in range(args.layers)
    ]
    groups = KVHandoffConfig().layer_group_ends(0, args.layers)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    decode_blocks = -(-args.tokens // args.decode_block_size) * 2
    shape = (args.layers, HEADS, HEAD_DIM)
    proc = ctx.Process(
        target=decode_main,
        args=(child, args.decode_block_size, "float32", decode_blocks, "owner", shape, 0.0002),
    )
    proc.start()
    senders, timers = {}, {}
    try:
        endpoint = conn.recv() if conn.poll(60) else None
        if endpoint is None:
            raise TimeoutError("decode did not start")
        for path in ("prepared", "general"):
            config = SenderConfig(
                0, 1, AllowList.loopback(), metadata_host=None, prepared_writes=path == "prepared"
            )
            agent = KVAgent(f"cpu-bench-{path}", progress=KVProgress.EVENT)
            senders[path] = KVSender(agent, [t.clone() for t in pool], 0, config)
            timers[path] = Timed(senders[path])
        order = torch.randperm(blocks * 2, generator=gen)[:blocks].tolist()
        src = tuple(order)
        for path, sender in senders.items():  # warm-up: NIXL connects, lists get prepared
            one_request(sender, conn, args, f"warm-{path}", src, groups)
        rows = []
        for run in range(args.runs):
            cpu = {path: [] for path in senders}
            before = {
                path: (t.start_s, t.post_s, s.writes_posted, s.prepared_posted)
                for (path, t), s in zip(timers.items(), senders.values(), strict=True)
            }
            for i in range(args.requests):
                paths = list(senders) if (run + i) % 2 == 0 else list(senders)[::-1]
                for path in paths:
                    rid = f"r{run}-{i}-{path}"
                    cpu[path].append(one_request(senders[path], conn, args, rid, src, groups))
            for path, sender in senders.items():
                t0, p0, w0, q0 = before[path]
                writes = sender.writes_posted - w0
                start_s, post_s = timers[path].start_s - t0, timers[path].post_s - p0
                rows.append(
                    {
                        "path": path,
                        "run": run,
                        "requests": args.requests,
                        "writes_per_request": writes / args.requests,
                        "prepared_share": round((sender.prepared_posted - q0) / writes, 3),
                        "sender_cpu_ms_per_request": round(1e3 * statistics.median(cpu[path]), 3),
                        "build_us_per_write": round(1e6 * (start_s - post_s) / writes, 1),
                        "post_us_per_write": round(1e6 * post_s / writes, 1),
                    }
                )
    finally:
        for sender in senders.values():
            sender.close()
        conn.send(("stop",))
        proc.join(20)
        if proc.is_alive():
            proc.kill()
    keys = ("sender_cpu_ms_per_request", "build_us_per_write", "post_us_per_write")
    for path in senders:
        mine = [r for r in rows if r["path"] == path]
        rows.append(
            {
                "path": path,
                "run": "median",
                **{k: statistics.median(r[k] for r in mine) for k in keys},
            }
        )
    summary = {r["path"]: r for r in rows if r["run"] == "median"}
    rows.append(
        {
            "path": "prepared/general",
            "run": "ratio",
            **{k: round(summary["prepared"][k] / summary["general"][k], 3) for k in keys},
        }
    )
    for r in rows:
        if r["run"] in ("median", "ratio"):
            print(r)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
