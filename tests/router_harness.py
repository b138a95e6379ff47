"""Real `wavepp serve` / `wavepp router` processes on loopback for the router tests."""

from __future__ import annotations

import subprocess
import sys

from prefill_node.cli.options import parse_listening
from prefill_node.process_tree import terminate
from tests.tiny_models import tiny_llama

CLI = [sys.executable, "-m", "prefill_node.cli.main"]
MODEL = tiny_llama("tiny-router", max_position_embeddings=512)  # vocab 64
BS = 4
SYSTEM = [(5 * i + 1) % 64 for i in range(64)]  # a shared 64-token "system prompt"


def spawn(args: list[str], banner: str) -> tuple[subprocess.Popen, int, int | None]:
    """Start ``wavepp ARGS`` on loopback; (process, port, metrics port) from its first line,
    which must be ``BANNER listening on 127.0.0.1:PORT``."""
    proc = subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    line = proc.stdout.readline()
    found = parse_listening(line)
    if found is None or f"wavepp {found.name}:" != banner or ":" not in found.target:
        proc.kill()
        raise AssertionError(f"unexpected first line {line!r}")
    host, port = found.target.rsplit(":", 1)
    assert host == "127.0.0.1", line
    return proc, int(port), found.metrics_port


def serve(
    model_dir, port: int = 0, wave_delay_s: float = 0.01, *extra: str
) -> tuple[subprocess.Popen, int]:
    """A 2-stage pipeline; every stage sleeps ``wave_delay_s`` per wave (keeps calls in
    flight long enough for a test to act on them). ``extra``: more flags (the KV hand-off,
    off by default, e.g. ``--kv-lease-ttl 5``, turns it on)."""
    shipping = list(extra) if extra else ["--no-kv-shipping"]
    proc, port, _ = spawn(
        ["serve", "--model", str(model_dir), "--stages", "2", "--num-blocks", "128",
         "--block-size", str(BS), "--max-chunk-tokens", "16", "--host", "127.0.0.1", "--port",
         str(port), "--metrics-port", "-1", "--threads", "1", "--log-level", "WARNING",
         *shipping, "--debug-wave-delay", str(wave_delay_s)],
        "wavepp serve:",
    )  # fmt: skip
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    terminate(proc)
