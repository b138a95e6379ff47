"""WavePPConnector's scheduler-side bookkeeping in the peer environment (real vLLM classes):
a load's report reaches its request's answer, and the report of a load whose request
finished first (a client gone mid-load, as behind vLLM's server) is dropped, not kept."""

from __future__ import annotations

import os
import subprocess

from tests_vllm.test_vllm_decode_e2e import REPO, _peer_python


def test_a_load_outliving_its_request_leaves_no_report_behind():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [str(_peer_python()), str(REPO / "tests_vllm" / "connector_bookkeeping_check.py")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )
