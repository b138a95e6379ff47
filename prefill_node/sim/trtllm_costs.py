"""Host costs of TensorRT-LLM's PP executor loop that move or walk whole prompts, per token.

The trtllm baseline (``executor_loops.py``) charges these on every rank's loop. Each is a
per-token cost of a data operation the PyTorch executor does on a long prompt, measured
here with our own code doing the same operations (``bench/trtllm_host_costs.py`` for the
Python conversions and pickling, ``bench/trtllm_walk.cpp`` for radix-tree walks), or a
switch read from source. Read from NVIDIA/TensorRT-LLM: ``tensorrt_llm/_torch/pyexecutor/
executor_request_queue.py`` at commit 007a7508b8f68d (``_broadcast_new_requests``,
``_merge_requests``), ``llm_request.py`` (``executor_request_to_llm_request``),
``model_engine.py`` (``_prepare_tp_inputs``), ``resource_manager.py`` (``update_resources``,
``free_resources``), ``py_executor.py`` at commit 0004396720054f (``_executor_loop_pp``).

WavePP is built on the same executor, so both policies pay every one of these costs unless
WavePP's design removes or moves it (``HOST_COST_CHARGES`` below: one line per cost, with the
mechanism for each exemption; docs/simulator.md has the same table). The zero default
(``TrtllmLoopCosts()``) is the walks-only model; the GPU presets use ``TRTLLM_PP_MEASURED``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from prefill_node.errors import InvalidRequestError

# bench/trtllm_host_costs.py, development VM, 2026-11-29: median of three runs' best,
# seconds per token of a 131,072-id prompt (ids < 150,000).
VEC_TO_LIST_S = 35.9e-9  # C++ vector -> Python list of ints (nanobind getter)
LIST_TO_VEC_S = 23.3e-9  # Python list -> C++ vector (constructor / __setstate__)
PICKLE_DUMPS_S = 22.9e-9  # pickle.dumps of the ready list inside the request payload
PICKLE_LOADS_S = 53.5e-9  # pickle.loads back to a list
COPY_S = 0.3e-9  # one copy of the 4.13 pickled bytes per token
# bench/trtllm_walk.cpp, same VM: walking a prompt with nothing cached costs 3.4 ns per
# token (copy it, cut it into 32-token block keys); each cached block found adds 27 ns per
# token (RoundCostSpec.walk_s_per_token).
WALK_BASE_S = 3.4e-9


class InvalidLoopCostError(InvalidRequestError):
    """A TensorRT-LLM loop cost is negative; the message names it."""


@dataclass(frozen=True)
class TrtllmLoopCosts:
    """Per-token host costs of one TensorRT-LLM PP rank's loop (seconds), and one switch.

    - ``send_s_per_token``: forwarding a new request to the next rank in
      ``_broadcast_new_requests``: mpi4py's ``send_object`` pickles the payload
      ``(new_requests, py_request_objects)``; the C++ ``tllm.Request`` pickles its prompt
      as a Python list (vector -> list, then dumps). Rank 0 and every rank but the last.
    - ``recv_s_per_token``: ``recv_object`` on ranks > 0: two copies of the pickled bytes
      (MPI over shared memory), loads, and the list -> vector of ``Request.__setstate__``.
    - ``merge_s_per_token``: ``_merge_requests`` -> ``executor_request_to_llm_request`` on
      every rank: ``executor_request.input_token_ids`` (vector -> list) passed to the
      ``LlmRequest`` constructor (list -> vector).
    - ``prepare_s_per_token``: ``model_engine._prepare_tp_inputs`` calls
      ``request.get_tokens(0)`` for every context request of the micro-batch, on every rank,
      and slices its chunk from that list: the whole prompt is converted, every chunk.
    - ``retire_walks``: radix-tree walks per prompt token when a request retires on a rank
      (``update_resources`` -> ``store_context_blocks`` and ``free_resources`` ->
      ``remove_sequence`` -> ``releaseBlocks`` -> ``storeBlocks``: both cut the prompt into
      block keys and find-or-insert every block), at ``walk_s_per_token`` each.
    - ``walk_base_s_per_token``: what any scheduler-pass walk costs per prompt token before
      it matches anything (copy and cut the prompt); the matched part is charged at
      ``RoundCostSpec.walk_s_per_token`` per cached token.
    - ``iteration_s``: fixed host seconds of one loop iteration on one rank, whatever it
      carries (the loop's Python: response handling, request-state updates, the sample
      state's ring, the forward's launch). Both policies pay it per wave per stage.
    - ``blocking_request_send``: ``_broadcast_new_requests`` forwards with the blocking
      ``send_object`` unless ``TRTLLM_PP_REQ_SEND_ASYNC=1`` (the source's comment: an
      asynchronous send can deadlock). A payload of new prompts is far above MPI's eager
      limit, so the send returns only once the next rank has posted its receive, at the
      top of ITS loop iteration: rank ``s`` cannot finish fetching iteration ``k`` before
      rank ``s + 1`` has launched micro-batch ``k - 1``. An empty payload goes eagerly.
    """

    send_s_per_token: float = 0.0
    recv_s_per_token: float = 0.0
    merge_s_per_token: float = 0.0
    prepare_s_per_token: float = 0.0
    retire_walks: float = 0.0
    walk_base_s_per_token: float = 0.0
    iteration_s: float = 0.0
    blocking_request_send: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool) and value < 0:
                raise InvalidLoopCostError(f"TrtllmLoopCosts.{f.name} must be >= 0, got {value}")

    def scaled(self, factor: float) -> TrtllmLoopCosts:
        """These costs with every time (not the switch) multiplied by ``factor``."""
        times = {f.name: getattr(self, f.name) * factor for f in fields(self) if f.type == "float"}
        return replace(self, **times)

    @property
    def admission_s_per_token(self) -> float:
        """What WavePP's admission pays per prompt token to move a new request to every stage
        and create it there: pickled once on the leader, unpickled and turned into a request
        on each stage in parallel, on the rounds timeline (``HOST_COST_CHARGES``)."""
        return self.send_s_per_token + self.recv_s_per_token + self.merge_s_per_token


# What the GPU presets' trtllm pays (the sources of each term are above).
TRTLLM_PP_MEASURED = TrtllmLoopCosts(
    send_s_per_token=VEC_TO_LIST_S + PICKLE_DUMPS_S,
    recv_s_per_token=2 * COPY_S + PICKLE_LOADS_S + LIST_TO_VEC_S,
    merge_s_per_token=VEC_TO_LIST_S + LIST_TO_VEC_S,
    prepare_s_per_token=VEC_TO_LIST_S,
    retire_walks=2.0,
    walk_base_s_per_token=WALK_BASE_S,
    blocking_request_send=True,
)


# Where each host cost of the executor lands, per policy. Every cost is charged to both
# policies with the same constant; ``wave`` moves some off the loop (to its admission
# rounds, which run concurrently with execution) and is exempt from two, each for the named
# mechanism of the WavePP design. docs/simulator.md shows the same table.
HOST_COST_CHARGES: tuple[tuple[str, str, str], ...] = (
    (
        "request transport: pickle, send, receive, unpickle (send_s_per_token, recv_s_per_token)",
        "every rank's loop, forwarded rank to rank with a blocking send",
        "admission rounds (moved off the loop: request transport is part of admission, "
        "broadcast to the stages on the rounds plane)",
    ),
    (
        "request creation, LlmRequest from the executor request (merge_s_per_token)",
        "every rank's loop",
        "admission rounds, every stage in parallel (moved off the loop, as above)",
    ),
    (
        "admission: prefix match, pin / allocate (RoundCostSpec.host_s_per_token)",
        "every rank's loop (add_sequence, first chunk)",
        "admission rounds, every stage in parallel (hint probe, lease, escrow: moved off the loop)",
    ),
    (
        "capacity scheduler pass re-walking every active request's cached prefix "
        "(walk_s_per_token, walk_base_s_per_token)",
        "every iteration, rank 0 and replayed on every other rank",
        "EXEMPT: capacity is settled once by the escrow in admission and the planner reads "
        "each admitted request's cached length; no per-iteration prefix walk",
    ),
    (
        "ranks > 0 re-check the schedule (can_schedule walk of the wave's requests)",
        "every iteration, ranks > 0",
        "EXEMPT: stage-local materialisation of (request, start, length) chunks against the "
        "stage's own lease and escrow; a mismatch fails the request, nothing is replayed",
    ),
    (
        "whole prompt to a Python list for every chunk (prepare_s_per_token)",
        "every rank's loop, every chunk",
        "every stage's loop, every chunk (the same model engine runs the forward)",
    ),
    (
        "retire: store the request's blocks and free the sequence, two walks of the prompt "
        "(retire_walks x walk_s_per_token)",
        "every rank's loop, P iterations after the last chunk",
        "every stage's loop, when the request's last chunk leaves the stage",
    ),
    (
        "fixed cost of a loop iteration (iteration_s)",
        "every rank, every wave",
        "every stage, every wave",
    ),
)
