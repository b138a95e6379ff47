"""`wavepp demo`, the README's main job, end to end on the bundled model: router + 2 pipelines
(4 stage processes) + a reference decode server + the gateway, driven by the openai SDK.
Checks the story it tells is the system's behaviour: a tenant's second question reuses its
system prompt on the same pipeline, decode answers from KV pulled over NIXL, a short
question is prefilled on decode, and after SIGKILL the tenant is served by the other
pipeline."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ASKED = re.compile(
    r"^\s+(?P<tenant>\S+)\s+(?P<pipeline>pipeline-\d)\s+prompt\s+(?P<prompt>\d+) tokens, "
    r"cached\s+(?P<cached>\d+), computed\s+(?P<computed>\d+) \| prefill (?P<prefill>\w+),"
)


def test_demo_routes_by_prefix_decodes_and_fails_over(default_model_cache):
    cache_dir, _ = default_model_cache
    env = {**os.environ, "WAVEPP_CACHE_DIR": str(cache_dir)}
    run = subprocess.run(
        [sys.executable, "-m", "prefill_node.cli.main", "demo", "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    served = [line for line in out.splitlines() if " serve " in line and line.startswith("$ ")]
    assert len(served) == 2 and all("--core-board" in line for line in served)  # one board
    asked = [m.groupdict() for m in map(ASKED.match, out.splitlines()) if m]
    assert len(asked) == 7  # 5 questions of two tenants, then 2 after the failover
    assert all(a["prefill"] == "remote" for a in asked)  # long prompts: on the tier
    before, after = asked[:5], asked[5:]
    for tenant in ("acme-travel", "globex-support"):
        mine = [a for a in before if a["tenant"] == tenant]
        assert int(mine[0]["cached"]) == 0
        assert all(int(a["cached"]) > 0 for a in mine[1:])  # the system prompt reused
        assert len({a["pipeline"] for a in mine}) == 1  # on the pipeline that holds it
    killed = re.search(r"SIGKILL (pipeline-\d)", out).group(1)
    assert killed == before[0]["pipeline"]
    assert all(a["pipeline"] != killed for a in after)
    assert int(after[0]["cached"]) == 0 and int(after[1]["cached"]) > 0
    assert "still serving: True" in out
    assert "-> The capital of France is Paris." in out  # decoded from KV pulled over NIXL
    assert "prefill local (short_suffix)" in out  # the short question stays on decode
    assert 'wavepp_gateway_kv_loads_total{outcome="ok"} 7.0' in out
    assert "demo done" in out
