"""A soak decode worker (child of bench/soak.py): a reference DecodeWorker (own NIXL agent and
KV pool) that keeps ``--concurrency`` hand-offs in flight through the router, alternating push
(the stages WRITE into blocks allocated here) and pull (this worker READs the leased blocks),
decodes two tokens from each, and releases. Every request is one JSON line on stdout before it
is sent and another once it ended; SIGTERM stops new requests, lets the in-flight ones end,
checks the decode side's invariants (receiver integrity, no block or reception left) and prints
a final line."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time

import grpc
from soak_cluster import CLIENT_BACKOFF_S  # bench/ is on sys.path: this file runs as a script

VOCAB = 512
TENANT_PREFIX = 96  # tokens of each decode tenant's shared prefix


def emit(row: dict) -> None:
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


async def wait_kv(worker, request_id: str, timeout_s: float) -> None:
    """``DecodeWorker.wait_kv`` without blocking the event loop (pump, then yield)."""
    from prefill_node.errors import KVHandoffError

    deadline = time.monotonic() + timeout_s
    while True:
        worker.pump()  # first: this loop may have been held past the deadline meanwhile
        if request_id in worker._outcomes:
            break
        if time.monotonic() > deadline:
            worker.receiver.cancel(request_id)
            raise KVHandoffError(f"KV of {request_id} did not arrive within {timeout_s}s")
        await asyncio.sleep(0.002)
    worker.wait_kv(request_id, 0)


async def one(worker, client, rng: random.Random, i: int, tag: str, args) -> dict:
    from prefill_node.client.prefill_client import to_remote_result
    from prefill_node.engine.types import KVPullDestination
    from prefill_node.errors import WaveppError

    mode = "push" if i % 2 == 0 else "pull"
    tenant = rng.randrange(4)
    prefix = [random.Random(f"decode-tenant-{tenant}").randrange(VOCAB) for _ in range(96)]
    prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(8, 120))]
    rid = f"{tag}-{i}"
    # one in four hand-offs ends early: a tight deadline, or the client cancels the call
    twist = rng.choice(("deadline", "cancel", "", "", "", "", "", ""))
    deadline = rng.uniform(0.05, 0.6) if twist == "deadline" else args.kv_timeout * 2
    kind = f"{mode}-{twist}" if twist else mode
    t0 = time.monotonic()
    row = {"kind": kind, "id": rid, "deadline_s": deadline, "t": time.time()}
    emit({"begin": rid, "kind": kind, "deadline_s": deadline})  # the parent tallies it open
    started = False
    try:
        # the reception outlives the prefill's own deadline: the stages WRITE until it answers
        dest = (
            worker.expect_push(rid, prompt, timeout_s=deadline + args.kv_timeout)
            if mode == "push"
            else KVPullDestination()
        )
        started = True
        call = client.prefill_call(
            prompt,
            request_id=rid,
            kv_destination=dest,
            cache_salt=f"decode-{tenant}",
            timeout_s=deadline,
            deadline_s=deadline + 10,
        )
        if twist == "cancel":
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.5), call.cancel)
        remote = to_remote_result(await call)
        row["prefill_s"] = time.monotonic() - t0
        if mode == "pull":
            worker.pull(rid, prompt, remote.result.stage_manifests)
        await wait_kv(worker, rid, args.kv_timeout)
        tokens = list(worker.generate(rid, remote.result.first_token_id, 2))
        row |= {"code": "OK", "tokens": len(tokens)}
    except grpc.RpcError as exc:
        row |= {"code": exc.code().name, "detail": (exc.details() or "")[:200]}
    except asyncio.CancelledError:
        row |= {"code": "CANCELLED"}
    except WaveppError as exc:  # decode-side hand-off failure after an OK prefill
        row |= {"code": "KV_" + type(exc).__name__, "detail": str(exc)[:200]}
    finally:
        if started:
            worker.release(rid)
    row["latency_s"] = time.monotonic() - t0
    row.setdefault("prefill_s", row["latency_s"])  # the answer's time: what deadlines bound
    return row


async def main_async(args) -> None:
    from kv_transfer.receiver import ReceiverConfig
    from prefill_node.client.prefill_client import AsyncPrefillClient
    from prefill_node.decode.decode_worker import DecodeWorker

    worker = DecodeWorker.from_model_dir(
        args.model,
        num_blocks=args.concurrency * 16 + 16,
        block_size=16,
        receiver_config=ReceiverConfig(timeout_s=args.kv_timeout),
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    rng = random.Random(args.seed)
    counter = iter(range(1 << 60))

    async def lane(client) -> None:
        while not stop.is_set():
            row = await one(worker, client, rng, next(counter), args.seed, args)
            emit(row)
            if row["code"] == "UNAVAILABLE":  # a client backs off
                await asyncio.sleep(rng.uniform(0.1, 0.5))

    async with AsyncPrefillClient(args.router, max_reconnect_backoff_s=CLIENT_BACKOFF_S) as client:
        await asyncio.gather(*(lane(client) for _ in range(args.concurrency)))
    final = {
        "final": True,
        "used_blocks": worker.used_blocks,
        "receptions": len(worker.receiver._pending),
        "integrity": "",
    }
    try:
        worker.check_integrity()
    except Exception as exc:  # noqa: BLE001 - reported, the parent counts it
        final["integrity"] = f"{type(exc).__name__}: {exc}"
    worker.close()
    emit(final)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", default="decode")
    p.add_argument("--kv-timeout", type=float, default=10.0)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
