"""Benchmark: kv_transfer push throughput vs raw NIXL between the same two processes.

Prefill side (this process): one KVSender holding all layers. Decode side: a spawned
process with a KVReceiver that polls in a loop. For each case and size, "ours" is
``push`` -> ``wait`` (planning, descriptors, staging if the dtype differs, notification,
completion); "raw" is a hand-made NIXL WRITE of the same destination bytes with
descriptors built outside the timed region (initialize_xfer + transfer + poll). Blocks are
random on both sides (a paged cache). Median of ``--runs`` runs; ratio = ours / raw.

``--progress`` runs every case once per NIXL progress mode (both agents in that mode; see
``kv_transfer.progress.KVProgress``): ``event`` (the default everywhere), ``poll`` (NIXL's
busy-polling thread) and ``owner`` (no thread; both loops poll). Rows carry ``progress``;
``vs_<first mode>`` is a mode's GB/s over the first mode's on the same case and size.

    PYTHONPATH=. python bench/nixl_throughput.py --json out/kv.json [--runs 5] [--tokens 256 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import time

import torch
from tqdm import tqdm

LAYERS, HEADS, HEAD_DIM, PREFILL_BS = 8, 8, 128, 16
# case -> (prefill dtype, decode block size, decode dtype)
CASES = {
    "same_layout": ("float16", 16, "float16"),
    "block_size_16_to_32": ("float16", 32, "float16"),
    "dtype_f32_to_bf16": ("float32", 16, "bfloat16"),
}


def decode_main(
    conn,
    block_size: int,
    dtype: str,
    num_blocks: int,
    progress: str,
    shape: tuple[int, int, int] = (LAYERS, HEADS, HEAD_DIM),
    poll_s: float = 0.0005,
) -> None:
    """A decode process for benchmarks: a receiver over a pool of ``shape`` (layers, KV
    heads, head dim), driven over ``conn``: "expect" (request id, tokens) -> destination
    (shuffled blocks); "finish" (request id, its blocks) -> whether it landed; "stop"."""
    from kv_transfer.agent import KVAgent
    from kv_transfer.progress import KVProgress
    from kv_transfer.receiver import KVReceiver

    layers, heads, head_dim = shape
    pool = [
        torch.zeros(num_blocks, 2, block_size, heads, head_dim, dtype=getattr(torch, dtype))
        for _ in range(layers)
    ]
    agent = KVAgent(f"bench-decode-{block_size}-{dtype}", progress=KVProgress(progress))
    rx = KVReceiver(agent, pool)
    conn.send(rx.endpoint)
    ended: set[str] = set()
    while True:
        if not conn.poll(poll_s):
            ended.update(o.request_id for o in rx.poll() if o.ok)
            continue
        op, *args = conn.recv()
        if op == "stop":
            break
        if op == "expect":
            request_id, num_tokens = args
            blocks = rx.allocate(-(-num_tokens // block_size))
            shuffled = tuple(torch.tensor(blocks)[torch.randperm(len(blocks))].tolist())
            conn.send(rx.expect(request_id, shuffled, num_tokens).to_dict())
        elif op == "finish":
            request_id, blocks = args
            deadline = time.monotonic() + 30
            while request_id not in ended and time.monotonic() < deadline:
                ended.update(o.request_id for o in rx.poll() if o.ok)
            conn.send(request_id in ended)
            ended.discard(request_id)
            rx.free(blocks)
    rx.close()


def call(conn, *cmd, timeout: float = 60.0):
    conn.send(cmd)
    if not conn.poll(timeout):
        raise TimeoutError(f"decode worker did not answer {cmd[0]}")
    return conn.recv()


def raw_write(sender, peer_name: str, local, remote) -> float:
    """Seconds for one raw NIXL WRITE of prebuilt descriptor lists, with a notification."""
    nixl = sender.agent.nixl
    started = time.perf_counter()
    handle = nixl.initialize_xfer("WRITE", local, remote, peer_name, b"raw")
    state = nixl.transfer(handle)
    while state == "PROC":
        state = nixl.check_xfer_state(handle)
    elapsed = time.perf_counter() - started
    if state != "DONE":
        raise RuntimeError(f"raw NIXL write ended in {state}")
    handle.release()
    return elapsed


class RawSource:
    """Where the raw WRITE reads from: the prefill pool itself when dtypes match, else a
    pre-registered buffer already in the decode dtype (what a hand-written client would
    keep), token-major like our staging tensor."""

    def __init__(self, sender, dst_layout, src_blocks, num_tokens: int) -> None:
        from kv_transfer.layout import layout_of_tensors
        from kv_transfer.plan import PageMap, staging_page_map

        self._sender, self._reg = sender, None
        if sender.layout.dtype == dst_layout.dtype:
            self.layout, self.pages = sender.layout, PageMap(src_blocks, PREFILL_BS)
            return
        self._buf = torch.zeros(
            LAYERS, 1, 2, num_tokens, HEADS, HEAD_DIM, dtype=getattr(torch, dst_layout.dtype)
        )
        self._reg = sender.agent.register_scratch(self._buf)
        self.layout, self.pages = (
            layout_of_tensors(0, list(self._buf)),
            staging_page_map(0, num_tokens),
        )

    def __enter__(self) -> RawSource:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._reg is not None:
            self._sender.agent.deregister(self._reg)


def run_case(case: str, sizes: list[int], runs: int, progress: str, bar) -> list[dict]:
    from kv_transfer.agent import KVAgent
    from kv_transfer.allowlist import AllowList
    from kv_transfer.messages import PushDestination
    from kv_transfer.plan import PageMap, build_descriptors, token_runs
    from kv_transfer.progress import KVProgress
    from kv_transfer.sender import KVSender, SenderConfig

    src_dtype, dst_bs, dst_dtype = CASES[case]
    max_tokens = max(sizes)
    src_blocks_total = max_tokens // PREFILL_BS + 1
    kv = [
        torch.randn(src_blocks_total, 2, PREFILL_BS, HEADS, HEAD_DIM).to(getattr(torch, src_dtype))
        for _ in range(LAYERS)
    ]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=decode_main,
        args=(child, dst_bs, dst_dtype, max_tokens // dst_bs + 1, progress),
        daemon=True,
    )
    proc.start()
    sender = KVSender(
        KVAgent(f"bench-prefill-{case}-{progress}", progress=KVProgress(progress)),
        kv,
        0,
        SenderConfig(0, 1, AllowList.loopback(), transfer_timeout_s=60, metadata_host=None),
    )
    rows = []
    try:
        if not conn.poll(120):
            raise TimeoutError("decode worker did not start")
        conn.recv()
        counter = 0
        for num_tokens in sizes:
            ours, raw = [], []
            for run in range(runs + 1):  # run 0 warms up (handshake, connection)
                counter += 1
                order = torch.randperm(src_blocks_total)[: -(-num_tokens // PREFILL_BS)]
                src = tuple(order.tolist())
                dest = PushDestination.from_dict(call(conn, "expect", f"r{counter}", num_tokens))
                started = time.perf_counter()
                sender.push(dest, src, num_tokens)
                outcome = sender.wait(dest.request_id, 60)
                elapsed = time.perf_counter() - started
                if not outcome.ok or not call(conn, "finish", dest.request_id, dest.block_ids):
                    raise RuntimeError(f"transfer failed: {outcome}")
                peer = sender._peers[dest.endpoint]
                with RawSource(sender, peer.layout, src, num_tokens) as raw_src:
                    descs = build_descriptors(
                        token_runs(raw_src.pages, PageMap(dest.block_ids, dst_bs), 0, num_tokens),
                        raw_src.layout,
                        peer.layout,
                        range(LAYERS),
                        src_is_local=True,
                    )
                    local = sender.agent.nixl.get_xfer_descs(descs.local, "DRAM")
                    remote = sender.agent.nixl.get_xfer_descs(descs.remote, "DRAM")
                    raw_s = raw_write(sender, peer.agent_name, local, remote)
                if run > 0:
                    ours.append(elapsed)
                    raw.append(raw_s)
                    bar.update(1)
            num_bytes = outcome.num_bytes
            ours_gbps = num_bytes / statistics.median(ours) / 1e9
            raw_gbps = num_bytes / statistics.median(raw) / 1e9
            rows.append(
                {
                    "case": case,
                    "progress": progress,
                    "tokens": num_tokens,
                    "bytes": num_bytes,
                    "descriptors": len(descs.local),
                    "ours_gbps": round(ours_gbps, 3),
                    "raw_nixl_gbps": round(raw_gbps, 3),
                    "ratio": round(ours_gbps / raw_gbps, 3),
                    "runs": runs,
                }
            )
    finally:
        sender.close()
        with contextlib.suppress(OSError):
            conn.send(("stop",))
        proc.join(20)
        if proc.is_alive():
            proc.kill()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the rows (a list of dicts) here")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--progress",
        nargs="+",
        default=["event", "poll"],
        choices=["event", "poll", "owner"],
        help="NIXL progress modes to compare, each on every case (default: event poll)",
    )
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be >= 3 (medians)")
    rows = []
    total = len(args.progress) * len(args.cases) * len(args.tokens) * args.runs
    with tqdm(total=total, desc="kv transfer") as bar:
        for case in args.cases:  # modes back to back per case: the VM drifts over minutes
            for progress in args.progress:
                rows += run_case(case, args.tokens, args.runs, progress, bar)
    base = {
        (r["case"], r["tokens"]): r["ours_gbps"] for r in rows if r["progress"] == args.progress[0]
    }
    for r in rows:
        r[f"vs_{args.progress[0]}"] = round(r["ours_gbps"] / base[r["case"], r["tokens"]], 3)
    header = f"{'case':<22}{'progress':>9}{'tokens':>7}{'MiB':>8}{'descs':>7}"
    print(header + f"{'ours GB/s':>11}{'raw GB/s':>10}{'ratio':>7}{'vs ' + args.progress[0]:>10}")
    for r in rows:
        print(
            f"{r['case']:<22}{r['progress']:>9}{r['tokens']:>7}{r['bytes'] / 2**20:>8.1f}"
            f"{r['descriptors']:>7}{r['ours_gbps']:>11.2f}{r['raw_nixl_gbps']:>10.2f}"
            f"{r['ratio']:>7.2f}{r[f'vs_{args.progress[0]}']:>10.2f}"
        )
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
