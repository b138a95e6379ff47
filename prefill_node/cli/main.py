"""Entry point of the `wavepp` console script: dispatches to one module per subcommand.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace, returns an exit code). Subcommand modules import
heavy dependencies (torch, grpc) inside their run function so that ``wavepp --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `wavepp --help` lists them.
SUBCOMMANDS: tuple[str, ...] = (
    "prefill_node.cli.demo",
    "prefill_node.cli.prefill",
    "prefill_node.cli.serve",
    "prefill_node.cli.router",
    "prefill_node.cli.gateway",
    "prefill_node.cli.sim",
    "prefill_node.cli.stage",
    "prefill_node.cli.decode",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wavepp",
        description=(
            "WavePP prefill tier: pipeline-parallel LLM prefill with prefix reuse, "
            "KV hand-off to decode workers, and a simulator of wave vs the TensorRT-LLM PP "
            "baseline."
        ),
    )
    from prefill_node import __version__

    parser.add_argument("--version", action="version", version=f"wavepp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the console script, not a call from Python: torch is not loaded yet
        from prefill_node.mkl_vendor import reexec_with_shim

        reexec_with_shim()
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
