"""`wavepp gateway` on the command line: its help, flags validated before it serves, and a
clean exit on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests import gateway_harness as h

CLI = [sys.executable, "-m", "prefill_node.cli.main", "gateway"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return h.model_dir(tmp_path_factory.mktemp("tiny-gateway-cli"))


def test_help_explains_the_policy_and_the_headers():
    run = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    for text in ("--prefill {auto,remote,local}", "--local-max-tokens", "--decode-kv-events",
                 "--k8s-service", "x-wavepp-prefill", "kv_transfer_params"):  # fmt: skip
        assert text in run.stdout, text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--decode", "127.0.0.1:9", "--prefill", "remote"], "--prefill remote needs --router"),
        (
            [
                "--decode",
                "127.0.0.1:9",
                "--decode",
                "127.0.0.1:10",
                "--decode-kv-events",
                "tcp://127.0.0.1:5557",
            ],
            "one --decode-kv-events per --decode",
        ),  # fmt: skip
        (["--decode", "http://host-without-port"], "lacks a host or a port"),
        (["--decode", "127.0.0.1:9", "--local-max-tokens", "-1"], "thresholds must be >= 0"),
    ],
)
def test_bad_flags_exit_2_saying_what_to_fix(model, flags, message):
    run = subprocess.run([*CLI, "--model", str(model), *flags], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_it_announces_its_port_and_exits_0_on_sigterm(model):
    proc, base = h.gateway(model, ["127.0.0.1:9"])  # nothing listens there: never ready
    try:
        assert h.get(f"{base}/health")[0] == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
