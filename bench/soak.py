"""Soak and chaos: the whole tier under load for a long time while things break.

Starts, as real processes on this machine: ``--pipelines`` pipelines (`wavepp serve --stages
2`, a tiny model, KV hand-off and the debug service on), the router in front of them, and
``--decoders`` decode workers (bench/soak_decode.py) doing push and pull hand-offs through
the router. This process keeps ``--concurrency`` requests in flight: tenants with shared
system prompts (cache_salt), unique prompts, PrefillStream batches, tight deadlines, client
cancellations and hostile requests (hypothesis-made fields and values, unknown fields,
oversize messages, unknown KV destinations).

Faults on a schedule (``--faults all`` for the full set, ``few`` for the default test),
each with its effect verified (bench/soak_faults.py): a decode worker SIGKILLed
mid-transfer; a stage SIGKILLed, and the leader (stage 0, the gRPC front) SIGKILLed (the
harness's supervisor restarts the pipeline, as Kubernetes would on failed liveness); a stage
SIGSTOPped past the heartbeat timeout, then SIGCONTed; the router SIGKILLed and restarted; a
pipeline's connections (its KV-event stream included) cut; a burst of long unique prompts
(cache pressure); two of them at once. Network faults (tc netem in namespaces) are skipped,
with the reason in the summary, where the machine cannot run them.

Invariants, continuously and at the end (bench/soak_report.py, bench/soak_outcomes.py): every
request ends exactly once, with a status expected for its kind or explained by a fault
overlapping it, never later than its deadline + 5 s; aborts of requests in flight take
effect; availability: with one component faulted at a time, >= 99% of the well-formed
requests without a short deadline or a client cancel end OK, and no other outcome is
unexplained; once load stops, every stage of every pipeline holds 0 used blocks, passes
check_integrity(), holds no WRITE or lease, and the decode side holds no block or reception;
RSS and fd counts of long-lived processes stop growing; the router's index equals what each
pipeline reports resident; the router's Prometheus counters equal the client's tally.

    python bench/soak.py --duration 60 --concurrency 32 --json out/soak.json --plot out/soak.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance
from soak_cluster import (  # bench/ is on sys.path: this file runs as a script
    CLIENT_BACKOFF_S,
    DecodeDriver,
    Restartable,
    Supervisor,
    TcpCut,
    pipeline_argv,
    router_argv,
    write_model,
)
from soak_faults import INJECTORS, Faults, fault_names, netem_unavailable, schedule
from soak_report import Sampler, final_checks, plot, residency, summarise
from soak_workload import Tally, Workload
from tqdm import tqdm


def _faults(value: str) -> str:
    try:
        fault_names(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="requests in flight (default 32: a load the 2-core VM carries with p95 under 2 s "
        "and one pipeline down, so availability measures faults, not overload; "
        "bench/overload.py measures overload)",
    )
    p.add_argument("--json", type=Path, required=True, help="where the rows go")
    p.add_argument("--plot", type=Path, help="summary plot over time (PNG)")
    p.add_argument("--pipelines", type=int, default=2)
    p.add_argument("--decoders", type=int, default=2, help="decode worker processes")
    p.add_argument("--decode-concurrency", type=int, default=4, help="hand-offs per decoder")
    p.add_argument("--num-blocks", type=int, default=384, help="KV blocks per stage")
    p.add_argument(
        "--kv-timeout",
        type=float,
        default=10.0,
        help="KV transfer timeout and pull lease TTL, seconds (default 10)",
    )
    p.add_argument(
        "--faults",
        type=_faults,
        default="all",
        help="all (default), few, none, or a comma-separated list of faults, a+b for two at "
        f"once ({', '.join(INJECTORS)})",
    )
    p.add_argument("--settle", type=float, default=60.0, help="seconds allowed to settle")
    p.add_argument("--seed", default="soak")
    p.add_argument("--logs", type=Path, help="keep every process's log here (default: dropped)")
    return p.parse_args(argv)


async def drive(
    args, router: Restartable, tally: Tally, faults: Faults, sampler: Sampler, bar: tqdm
) -> None:
    """Load for ``args.duration`` seconds, faults on their schedule; returns once every
    request sent has ended."""
    from prefill_node.client.prefill_client import AsyncPrefillClient

    end = time.monotonic() + args.duration
    async with AsyncPrefillClient(
        router.address, max_reconnect_backoff_s=CLIENT_BACKOFF_S
    ) as client:
        work = Workload(client, client._channel, tally, args.seed)
        faults.workload = work

        async def lane(i: int) -> None:
            while time.monotonic() < end:
                unavailable = tally.outcomes["UNAVAILABLE"]
                await work.step()
                bar.update()
                if tally.outcomes["UNAVAILABLE"] > unavailable:  # a client backs off
                    await asyncio.sleep(work.rng.uniform(0.1, 0.5))

        async def watch() -> None:
            while time.monotonic() < end:
                t = time.monotonic()
                await asyncio.sleep(1.0)
                sampler.loop_lag_s = time.monotonic() - t - 1.0  # this process's own delay
                sampler.sample(tally)
                bar.set_postfix_str(sampler.postfix(tally))

        plan = schedule(args.faults, args.duration)
        ticker = asyncio.create_task(tally.tick())
        lanes = [asyncio.create_task(lane(i)) for i in range(args.concurrency)]
        runner = asyncio.create_task(faults.run(plan, end))
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*lanes)
        await runner
        await watcher
        ticker.cancel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run finallys
    args.json.parent.mkdir(parents=True, exist_ok=True)
    started, stamp = time.monotonic(), provenance()  # the code and the time the run began
    with tempfile.TemporaryDirectory(prefix="wavepp-soak-") as tmp:
        tmp = Path(tmp)
        model = write_model(tmp / "model")
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            tmp = args.logs
        tally = Tally()
        pipes = [
            Restartable(
                f"pipeline-{i}", pipeline_argv(model, f"pipeline-{i}", args), "wavepp serve:", tmp
            )
            for i in range(args.pipelines)
        ]
        cut = TcpCut(pipes[0].address)  # the router reaches pipeline 0 through it
        routes = [cut, *pipes[1:]]
        router = Restartable("router", router_argv(model, routes), "wavepp router:", tmp)
        decoders = [
            DecodeDriver(f"decode-{i}", router.address, model, args, tmp, tally)
            for i in range(args.decoders)
        ]
        supervisor = Supervisor(pipes, lambda *a: faults.note_restart(*a))
        faults = Faults(pipes, router, decoders, supervisor, cut, tally, residency=residency)
        if args.faults != "none":
            why = netem_unavailable()
            faults.network = (f"skipped: {why}" if why else
                              "skipped: tc netem works here, but delay and loss faults are "
                              "not implemented yet")  # fmt: skip
        try:
            print(
                f"starting {args.pipelines} pipelines, the router and {args.decoders} "
                "decode workers",
                flush=True,
            )
            for p in pipes:
                p.start()
            router.start()
            if not faults.wait_router_ready(timeout_s=300):
                raise RuntimeError("the router did not see every pipeline ready")
            faults.router_epoch = time.monotonic()  # nothing was sent yet: its counters are 0
            supervisor.start()
            for d in decoders:
                d.start()
            sampler = Sampler(pipes, router, decoders)
            print(
                f"ready after {time.monotonic() - started:.0f}s; load for {args.duration:.0f}s "
                f"at concurrency {args.concurrency}",
                flush=True,
            )
            with tqdm(desc="soak requests", unit="req", mininterval=2.0) as bar:
                asyncio.run(drive(args, router, tally, faults, sampler, bar))
            decode_finals = [d.stop() for d in decoders]
            supervisor.stop()
            checks = final_checks(pipes, router, decode_finals, tally, faults, args)
            rows = summarise(args, tally, faults, sampler, checks)
            rows[0] |= stamp | {"finished_utc": provenance()["date_utc"]}
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
            if args.plot is not None:
                plot(sampler, faults, args.plot)
        finally:
            for d in decoders:
                d.kill()
            router.stop()
            for p in pipes:
                p.stop()
            cut.stop()
    summary = rows[0]
    bad = {k: summary[k] for k in summary["invariants"] if summary[k]}
    print(json.dumps(summary, indent=1))
    print(
        f"soak done in {time.monotonic() - started:.0f}s: "
        f"{'INVARIANTS BROKEN: ' + str(bad) if bad else 'all invariants hold'}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
