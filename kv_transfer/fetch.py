"""Prefix fetch: a stage READs its layers of a prefix that another pipeline's stages hold.

The other pipeline holds the prefix under pull leases (its stages' answer to LeasePrefix:
one ``StageManifest`` per stage, the lease decode READs under). A fetching stage READs, from every
manifest whose layers overlap its own, the overlap's tokens ``[start, end)`` into its own
blocks (block sizes may differ: the plan maps token runs; layer splits may differ: each
pair moves the layers both hold). The READs carry no notification: with different splits
one leased stage is read by several fetching stages, so its lease is released only once
every one of them is done (``LeasePeers.notify(manifests, "rel")`` from one agent).

Sans threads: the caller posts with ``start_fetch`` and drives with ``wait_fetch`` on the
thread that owns the agent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kv_transfer.agent import KVAgent
from kv_transfer.convert import KVLayer
from kv_transfer.errors import KVTransferError, LayoutMismatch, TransferTimeout
from kv_transfer.handshake import LeasePeers
from kv_transfer.layout import KVLayout
from kv_transfer.messages import StageManifest
from kv_transfer.plan import PageMap
from kv_transfer.transfer import NixlTransfer, start_transfer


def start_fetch(
    agent: KVAgent,
    peers: LeasePeers,
    local_layers: Sequence[KVLayer],
    local_layout: KVLayout,
    local_pages: PageMap,
    manifests: Sequence[StageManifest],
    start: int,
    end: int,
) -> list[NixlTransfer]:
    """Post the READs of tokens ``[start, end)`` of every local layer from the manifests
    holding it. LayoutMismatch when the manifests leave a local layer uncovered or hold
    fewer tokens; any KVTransferError aborts what was posted (nothing stays in flight)."""
    lo_local, hi_local = local_layout.layer_start, local_layout.layer_end
    spans = sorted(
        (max(m.layout.layer_start, lo_local), min(m.layout.layer_end, hi_local), m)
        for m in manifests
        if m.layout.layer_start < hi_local and lo_local < m.layout.layer_end
    )
    covered = lo_local
    for lo, hi, _ in spans:
        if lo > covered:
            break
        covered = max(covered, hi)
    if covered < hi_local:
        raise LayoutMismatch(
            f"the source's stages leave layers [{covered}, {hi_local}) of this stage uncovered"
        )
    short = [m.stage for _, _, m in spans if m.num_tokens < end]
    if short:
        raise LayoutMismatch(f"source stages {short} hold fewer than {end} tokens")
    reads: list[NixlTransfer] = []
    try:
        done = lo_local  # overlapping manifests (should not happen) are read once
        for lo, hi, m in spans:
            lo = max(lo, done)
            if lo >= hi:
                continue
            peers.peer(m.endpoint, m.agent_name)
            first = lo - lo_local
            reads.append(
                start_transfer(
                    agent,
                    "READ",
                    m.agent_name,
                    b"",
                    local_layers=local_layers[first : first + hi - lo],
                    local_layout=local_layout.restrict(lo, hi),
                    local_pages=local_pages,
                    remote_layout=m.layout.restrict(lo, hi),
                    remote_pages=PageMap(m.block_ids, m.layout.block_size),
                    start=start,
                    end=end,
                )
            )
            done = hi
    except KVTransferError:
        for read in reads:
            read.abort()
        raise
    return reads


def wait_fetch(
    reads: Sequence[NixlTransfer],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    pause_s: float = 0.0002,
) -> None:
    """Drive the READs until every one landed. On a failure or after ``timeout_s`` the
    rest are aborted before it raises (TransferFailed / TransferTimeout), so no READ is
    left writing into the caller's blocks."""
    deadline = clock() + timeout_s
    try:
        while not all([read.check() for read in reads]):
            if clock() > deadline:
                raise TransferTimeout(f"the prefix fetch did not land within {timeout_s}s")
            time.sleep(pause_s)
    except KVTransferError:
        for read in reads:
            read.abort()
        raise
