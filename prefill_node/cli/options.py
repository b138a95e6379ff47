"""Command-line options shared by several wavepp subcommands."""

from __future__ import annotations

from typing import Any

KV_PROGRESS_HELP = (
    "how NIXL agents advance transfers: 'event' (default) sleeps until UCX signals traffic, "
    "so an idle process uses no CPU; 'poll' busy-polls one core per agent for the lowest "
    "wake-up latency (microseconds), worth it only on dedicated hosts with a spare core"
)


def add_kv_progress(group: Any) -> None:
    """``--kv-progress {event,poll}`` -> ``args.kv_progress`` (a ``KVProgress``)."""
    from kv_transfer.progress import KVProgress

    group.add_argument(
        "--kv-progress",
        type=KVProgress,
        choices=(KVProgress.EVENT, KVProgress.POLL),
        default=KVProgress.EVENT,
        metavar="{event,poll}",
        help=KV_PROGRESS_HELP,
    )
