"""Entry point of a non-leader stage process (``wavepp stage`` and the local launcher)."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import time

import torch
import torch.distributed as dist

from prefill_node import tracing
from prefill_node.runtime.core_share import FD_ENV, CoreBoard, CoreShare
from prefill_node.runtime.dist_env import DistEnv
from prefill_node.runtime.heartbeat import Heartbeat
from prefill_node.runtime.launcher import STAGE_CPU_ENV, pin_to_cpu
from prefill_node.runtime.planes import PlaneClosedError, Planes
from prefill_node.runtime.spec import PipelineSpec
from prefill_node.runtime.stage_worker import StageWorker

log = logging.getLogger("wavepp.stage")

SPEC_KEY = "wavepp/spec"
KV_HANDOFF_KEY = "wavepp/kv_handoff"  # pickled KVHandoffConfig or None (set before SPEC_KEY)
REVISION_KEY = "wavepp/revision"  # the leader's DistEnv.revision (set before SPEC_KEY)
EXIT_LEADER_LOST = 3
EXIT_STAGE_FAILED = 4
EXIT_PIPELINE_LOST = 5  # the leader (`wavepp serve`): a stage died, the pipeline is lost
EXIT_REVISION_MISMATCH = 6  # the leader runs another deployment revision than this stage


def ready_key(rank: int) -> str:
    return f"wavepp/ready/{rank}"


def connect_store(env: DistEnv, timeout_s: float) -> dist.TCPStore:
    """A client of the leader's rendezvous store (the leader hosts it on MASTER_PORT)."""
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run_stage(
    env: DistEnv, connect_timeout_s: float = 600.0, otlp_endpoint: str | None = None
) -> int:
    """Join the pipeline as stage ``env.rank`` (>= 1) and serve until the leader stops it.

    Contract: gets the PipelineSpec from the leader's store, loads only its layer slice and
    allocates only its KV, announces readiness, joins the planes, then runs LOOP + WAVE.
    Returns 0 after a clean STOP, EXIT_REVISION_MISMATCH (without joining) when the leader
    runs another revision (``DistEnv.revision``). Exits the process (code 3) as soon as the
    leader is lost - a stage without its leader has nothing left to do, and must not hold
    its memory. Traces as ``wavepp-stage-RANK`` to ``otlp_endpoint``, else the environment's
    (a locally launched stage inherits its leader's), else not at all.
    """
    if env.is_leader:
        raise ValueError("rank 0 is the leader: start it with `wavepp serve/prefill --stages`")
    tracing.configure(f"wavepp-stage-{env.rank}", otlp_endpoint)
    torch.set_num_threads(1)
    cpu = os.environ.get(STAGE_CPU_ENV)
    pin_to_cpu(int(cpu) if cpu else None)
    store = connect_store(env, connect_timeout_s)
    store.wait([SPEC_KEY], datetime.timedelta(seconds=connect_timeout_s))
    leader_revision = store.get(REVISION_KEY).decode()
    if leader_revision != env.revision:
        log.error(
            "stage %d: revision %r, the leader at %s runs %r; not joining (exit %d)",
            env.rank,
            env.revision,
            env.master_addr,
            leader_revision,
            EXIT_REVISION_MISMATCH,
        )
        return EXIT_REVISION_MISMATCH
    spec = PipelineSpec.from_json(store.get(SPEC_KEY).decode())
    if spec.num_stages != env.world_size:
        raise ValueError(
            f"WORLD_SIZE={env.world_size} but the leader runs {spec.num_stages} stages"
        )

    from prefill_node.runtime.stage_compute import build_stage_compute

    kv_handoff = pickle.loads(store.get(KV_HANDOFF_KEY))  # the leader's trusted store
    seat = os.environ.get(FD_ENV)  # the local launcher's core-sharing board
    cores = CoreShare(*CoreBoard.attach(seat)) if seat else None
    compute = build_stage_compute(spec, env.rank, kv_handoff, cores)
    store.set(ready_key(env.rank), "1")
    planes = Planes.join_stage(env.rank, env.world_size, store, compute.model, spec.max_wave_tokens)
    worker = StageWorker(
        env.rank,
        env.world_size,
        planes,
        compute,
        admission_on_loop=spec.scheduling_policy.admission_on_loop,
    )

    def leader_lost(reason: str) -> None:
        log.error("stage %d: leader lost (%s); exiting", env.rank, reason)
        tracing.shutdown()  # os._exit skips atexit: export the spans buffered so far
        os._exit(EXIT_LEADER_LOST)

    heartbeat = Heartbeat(env, leader_lost, spec.heartbeat_s, spec.dead_after_s)
    heartbeat.start()
    worker.start()
    while worker.loop_thread.is_alive() and worker.wave_thread.is_alive():
        time.sleep(0.25)  # a dead thread ends the stage; heartbeats cover hangs
    if isinstance(worker.error, PlaneClosedError):
        leader_lost(str(worker.error))
    if worker.error is not None:
        log.error("stage %d failed: %r; exiting", env.rank, worker.error)
        tracing.shutdown()
        os._exit(EXIT_STAGE_FAILED)
    worker.join(timeout=spec.dead_after_s)
    compute.close()
    worker.close_reports()  # after the last outcome: the leader's receiver ends
    if cores is not None:
        cores.board.close()
    heartbeat.stop()
    Planes.close()
    return 0


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    code = run_stage(DistEnv.from_env())
    tracing.shutdown()  # before os._exit, which skips atexit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is released; skip the interpreter's slow teardown of torch and gloo threads
    # so that a local pipeline shuts down in well under a second.
    os._exit(code)


if __name__ == "__main__":
    main()
