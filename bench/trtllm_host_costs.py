"""Per-token host costs of TensorRT-LLM's PyTorch PP executor that move whole prompts.

Feeds ``TrtllmLoopCosts`` (prefill_node/sim/trtllm_costs.py). Each case does, with our own
code, the data operations TensorRT-LLM does on every PP rank for a long prompt (read at
NVIDIA/TensorRT-LLM; the simulator's docstrings cite the functions and commits):

- ``vec_to_list``: a C++ ``std::vector<int32>`` of token ids handed to Python as a list (the
  nanobind getters ``Request.input_token_ids`` and ``LlmRequest.get_tokens(0)``); here an
  int32 numpy array's ``tolist()``, which also creates one Python int per token.
- ``list_to_vec``: a Python list of ids converted back into a C++ vector (the ``LlmRequest``
  constructor, ``Request.__setstate__``); here ``array.array('i', list)``, which also
  converts every Python int.
- ``pickle_dumps`` / ``pickle_loads``: mpi4py's ``comm.send`` / ``recv`` of the new-request
  payload ``([RequestQueueItem(id, request)], None)`` (``_broadcast_new_requests``), where
  the request pickles its prompt as a list of ints; ``vec_to_list`` / ``list_to_vec`` are
  timed separately, these cases time pickling a ready list and unpickling to a list.
- ``copy``: moving the pickled bytes once (MPI over shared memory copies in and out).

Prompt: 131,072 ids drawn from [0, 150,000) (a GLM-5 / MiniMax-M2-sized vocabulary: ids
above 65,535 pickle as 5-byte BININT). ``--reps`` runs per case (default 25); the row keeps
the best (the cost on an otherwise idle core, what the simulator uses: this VM is shared,
and other load only adds, so the best favours the baseline) and the median.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/trtllm_host_costs.py --json out.json

Measured on the development VM (2 shared cores, load ~1.1, nice 19, 2026-11-29), three
runs, median of the three per-run bests, ns per token: vec_to_list 35.9, list_to_vec 23.3,
pickle_dumps 22.9, pickle_loads 53.5, copy 0.3 (pickled payload 4.13 bytes per token). Rows
in the lead's notes (not in the repo).
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import json
import pickle
import statistics
import time
from collections.abc import Callable

import numpy as np

TOKENS = 131_072
VOCAB = 150_000


@dataclasses.dataclass
class FakeRequest:
    """Stands for the C++ ``tllm.Request``: pickles as its prompt list plus small fields."""

    input_token_ids: list[int]
    max_tokens: int = 1
    streaming: bool = False


@dataclasses.dataclass
class QueueItem:
    """Stands for ``RequestQueueItem`` (executor_request_queue.py)."""

    id: int
    request: FakeRequest | None = None
    child_req_ids: list[int] | None = None
    is_canceled_request: bool = False


def _times_s(fn: Callable[[], object], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure(reps: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(0)
    vec = rng.integers(0, VOCAB, TOKENS, dtype=np.int32)
    ids = vec.tolist()
    payload = ([QueueItem(7, FakeRequest(ids))], None)
    blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    cases: dict[str, Callable[[], object]] = {
        "vec_to_list": vec.tolist,
        "list_to_vec": lambda: array.array("i", ids),
        "pickle_dumps": lambda: pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL),
        "pickle_loads": lambda: pickle.loads(blob),
        "copy": lambda: bytes(bytearray(blob)),
    }
    rows = []
    for name, fn in cases.items():
        fn()  # warm up allocators
        times = _times_s(fn, reps)
        best, median = min(times), statistics.median(times)
        rows.append(
            {
                "case": name,
                "tokens": TOKENS,
                "best_s": best,
                "median_s": median,
                "ns_per_token": best / TOKENS * 1e9,
                "median_ns_per_token": median / TOKENS * 1e9,
                "pickled_bytes_per_token": len(blob) / TOKENS,
                "reps": reps,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=25, help="runs per case (>= 3)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    rows = measure(max(3, args.reps))
    for r in rows:
        print(
            f"{r['case']:>13}: best {r['ns_per_token']:5.1f} ns/token, "
            f"median {r['median_ns_per_token']:5.1f} ({r['median_s'] * 1e3:.2f} ms)"
        )
    print(f"pickled payload: {rows[0]['pickled_bytes_per_token']:.2f} bytes per token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
