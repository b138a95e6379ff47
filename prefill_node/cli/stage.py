"""`wavepp stage`: run one non-leader pipeline stage from torchrun-style environment variables."""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = """\
Join a multi-process WavePP pipeline as one stage (one pod per stage on Kubernetes).
The stage reads RANK (its stage index, >= 1), WORLD_SIZE (number of stages), MASTER_ADDR
and MASTER_PORT (the leader, stage 0, started with `wavepp serve --stages N` or
`wavepp prefill --stages N` and the same variables with RANK=0). It gets the model and
cache settings from the leader, loads only its own layers, and serves until the leader
stops it; it exits with code 3 as soon as the leader is lost.

example (the leader runs on host pipe-0):
  RANK=1 WORLD_SIZE=2 MASTER_ADDR=pipe-0 MASTER_PORT=29500 wavepp stage
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "stage",
        help="run one pipeline stage (RANK >= 1) from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long to wait for the leader's store and spec (default 600)",
    )
    from prefill_node.cli.options import add_tracing_argument

    add_tracing_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from prefill_node.runtime.dist_env import DistEnv
    from prefill_node.runtime.stage_main import run_stage

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    env = DistEnv.from_env()
    return run_stage(env, connect_timeout_s=args.connect_timeout, otlp_endpoint=args.otlp_endpoint)
