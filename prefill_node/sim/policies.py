"""How the simulator times the three policies: ``wave`` (WavePP), ``trtllm`` (TRT-LLM PP) and
``sync-admission`` (the ablation), and on which executor a preset's pipeline runs.

The policy itself (its knobs: ring, chunks in flight, planner, fragment rule, headroom) is
``prefill_node.core.policy.Policy``, shared with the runtime; this module keeps only the
choice of executor (``ExecutorKind``).

- WAVE: admission rounds run on their own timeline, concurrently with execution: a round
  starts as soon as requests are pending and the previous round is over, and packs up to
  ``max_round_requests`` of them. Waves are planned by the MPU planner (or an ablation),
  a request's successive chunks may be in flight in successive waves (each stage handles
  waves in order, so chunk k+1 on stage s always runs after chunk k on stage s), and up to
  ``R = 2P`` waves are in flight. Per-request host work (``host_s_per_token``) is paid once
  per stage, in the rounds, off the executor loops.
- TRTLLM: TensorRT-LLM's PyTorch PP executor (``PyExecutor._executor_loop_pp``, read at
  NVIDIA/TensorRT-LLM commit 0004396720054f). Every rank runs its own executor loop and
  does its host work for a micro-batch serially on it before launching that micro-batch
  (``executor_loops.py`` has the timing model and its source citations): every rank
  fetches the new requests, which rank 0 pickles and each rank unpickles and forwards with
  a blocking send (so a rank's fetch waits for the next rank's loop to come round) and
  turns into ``LlmRequest``s (``trtllm_costs.py``: per prompt token, measured); rank 0
  schedules (capacity scheduler pass that walks the cached prefix of every admitted
  context-phase request, ``walk_s_per_token`` each token), sends the schedule down the
  chain; every other rank receives it, re-checks and replays the same pass on its own
  cache (``_pp_retry_until_can_schedule``, ``scheduler.schedule_request``); every rank runs
  ``prepare_resources`` (``add_sequence``: prefix match + allocation on its own cache for
  each first-chunk request, ``host_s_per_token`` per prompt token, the same constant a
  WavePP stage pays per request) and converts each scheduled request's whole prompt to a
  Python list (``_prepare_tp_inputs``); then launches the forward, blocks on its GPU's
  previous micro-batch, receives the sample state of the micro-batch ``P - 1`` back and
  retires it (two more walks of each finished prompt) before the next iteration. A stage's
  GPU starts a wave only when its own rank has launched it. Fixed chunk budget ``M`` filled to
  the brim (no fragment rule), ``P`` micro-batches in flight (``num_micro_batches =
  pp_size``), at most one chunk of a request in flight (``inflight_req_ids``). The
  admission core's round is applied at rank 0's iteration with no time of its own: in
  TRT-LLM there is no cross-stage negotiation, its cost is the loop work above. Not
  modelled here: a rank > 0 that cannot fit rank 0's schedule retries only while
  disaggregated KV transfers drain and otherwise raises (``_pp_retry_until_can_schedule``);
  the simulated round still takes the admission core's all-stage capacity decision, so that
  never happens. The runtime's ``trtllm`` policy does run it: stage 0 admits from its own
  cache alone and the other stages follow (``StageAdmission.follow``,
  ``runtime/leader.py``).

- SYNC_ADMISSION: the ablation of our own runtime (``leader_rounds.py``: the leader runs the
  3-phase admission rounds synchronously on stage 0's execution loop, the other stages
  answer them between waves, no scheduler prefix walks and no per-rank replay; same fixed
  M, ``P`` waves in flight, one chunk of a request in flight), which the ``cpu-bench``
  preset is compared on with the real CPU pipeline (``bench/sim_vs_pipeline.py``).

``ExecutorKind`` says on which executor a preset's pipeline runs, which sets the host work
``wave`` keeps on each stage's loop: ``TRTLLM`` (the GPU presets: WavePP is built on
TensorRT-LLM's executor, ``stage_hosts.py``) or ``WAVEPP_RUNTIME`` (``cpu-bench``: our
runtime, whose loop costs are in the measured chunk costs).

Both policies drive the same admission core with the same per-token host cost; only when
and where the host work runs, how often the scheduler repeats its prefix walks, and how
waves are formed differ.
"""

from __future__ import annotations

import enum


class ExecutorKind(enum.Enum):
    """The executor a preset's pipeline runs on (see the module docstring)."""

    TRTLLM = "trtllm-executor"
    WAVEPP_RUNTIME = "wavepp-runtime"
