"""Simulator benchmark: `wavepp sim`, by default over the paper's grid (wave vs trtllm).

    python bench/sim.py --json sim.json --plot sim.png        # == wavepp sim --sweep paper ...
    python bench/sim.py --preset kimi-pp8 --workload suffix4k  # any `wavepp sim` arguments

The simulator is deterministic (same seed, same numbers), so one run per setting is the
median of any number of runs; vary --seed to see the spread of the mixed workload.
"""

from __future__ import annotations

import sys

from prefill_node.cli.main import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    single = {"--workload", "--input-len", "--concurrency", "--sweep"}
    if not single.intersection(argv):
        argv = ["--sweep", "paper", *argv]
    sys.exit(main(["sim", *argv]))
