"""NixlTransfer: one posted NIXL WRITE or READ between a local and a remote paged pool.

Equal dtypes move directly between the pools (token runs, any block sizes). Different dtypes,
or a local pool NIXL cannot address (a geometry-only layout over strided views, e.g. vLLM's
CPU cache), go through a registered staging tensor in the remote dtype: packed before a WRITE,
unpacked into the local pool after a READ (convert.py). The notification rides on the
transfer, so NIXL delivers it to the remote agent only after the data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from kv_transfer.agent import KVAgent
from kv_transfer.convert import KVLayer, layer_device, pack_staging, torch_dtype, unpack_staging
from kv_transfer.errors import KVTransferError, LayoutMismatch, TransferFailed
from kv_transfer.layout import KVLayout, layout_of_tensors
from kv_transfer.plan import (
    Descriptors,
    PageMap,
    build_descriptors,
    concat,
    staging_page_map,
    state_descriptors,
    token_runs,
)
from kv_transfer.staging import Staging

log = logging.getLogger(__name__)


# how long a final push is checked without pause right after it is posted (``drive``)
FINAL_DRIVE_S = 0.001


def drive(*transfers: NixlTransfer) -> None:
    """Right after a final push is posted (or handed over, for the ranges it waits on):
    check them until done, for at most ``FINAL_DRIVE_S``. A notification leaves only through
    this agent's progress, which the checks make (measured: NIXL's progress thread does not
    carry a WRITE this agent posted); the WRITE itself is mostly done by the post, so this
    saves decode most of a poll interval, once per request."""
    limit = time.monotonic() + FINAL_DRIVE_S
    try:
        while not all(t.check() for t in transfers) and time.monotonic() < limit:
            time.sleep(0)  # let the stage's other threads have the GIL between checks
    except KVTransferError:
        pass  # the next check in the sender's ``poll`` reports it


class NixlTransfer:
    """Owns a NIXL request handle and its staging tensor until done or aborted."""

    def __init__(
        self,
        agent: KVAgent,
        num_bytes: int,
        handle: Any | None = None,
        staging: Staging | None = None,
        unpack: tuple[Sequence[KVLayer], PageMap, int, int] | None = None,
    ) -> None:
        self.agent = agent
        self.num_bytes = num_bytes
        self._handle = handle
        self._staging = staging
        self._unpack = unpack
        self.done = handle is None

    def check(self) -> bool:
        """True once the data landed (and, for a staged READ, was unpacked).

        Raises TransferFailed when NIXL reports an error (e.g. the peer died).
        """
        if self.done:
            return True
        try:
            state = self.agent.nixl.check_xfer_state(self._handle)
        except Exception as exc:
            raise TransferFailed(f"NIXL transfer failed: {exc!r}") from exc
        if state == "PROC":
            return False
        if state != "DONE":
            raise TransferFailed(f"NIXL transfer ended in state {state}")
        if self._unpack is not None:
            layers, pages, start, end = self._unpack
            unpack_staging(self._staging.tensor, layers, pages, start, end)
        self._release()
        self.done = True
        return True

    def abort(self) -> None:
        """Cancel if still running. If NIXL cannot cancel, the staging stays registered
        and referenced by the agent until it closes (never freed under a live transfer)."""
        if self.done:
            return
        self.done = True
        try:
            self._release()
        except Exception as exc:
            log.warning("NIXL could not cancel a transfer (%r); parking its buffers", exc)
            self.agent.park((self._handle, self._staging))

    def _release(self) -> None:
        if self._handle is not None:
            self._handle.release()
            self._handle = None
        if self._staging is not None:
            self.agent.staging.release(self._staging)
            self._staging = None


def start_transfer(
    agent: KVAgent,
    op: str,
    remote_agent: str,
    notif: bytes,
    *,
    local_layers: Sequence[KVLayer],
    local_layout: KVLayout,
    local_pages: PageMap,
    remote_layout: KVLayout,
    remote_pages: PageMap,
    start: int,
    end: int,
    state_slots: tuple[int, int] | None = None,
    state_layout: KVLayout | None = None,
) -> NixlTransfer:
    """Post a WRITE (local -> remote) or READ (remote -> local) of tokens ``[start, end)``
    of the layers both pools share, with ``notif`` delivered to ``remote_agent`` after it
    (an empty range posts nothing and sends no notification). ``state_slots``: (stage-side
    block, other side's block) whose recurrent-state slots of the stage's recurrent layers
    ride along (a hybrid pool's final push / pull: the state after the prompt's last token);
    ``state_layout``: a WRITE's stage-side layout whose recurrent layers those are (default
    ``local_layout``; a final push after layer-group ranges WRITEs the blocks of its last
    layers only, but the states of all the stage's layers).

    The stage side's layers (local for WRITE, remote for READ) must all be covered by
    the other pool. Raises a KVTransferError subclass; never leaves a half-posted request.
    """
    stage_side, other = (
        (local_layout, remote_layout) if op == "WRITE" else (remote_layout, local_layout)
    )
    other.check_compatible(stage_side)
    if not other.covers(stage_side.layer_start, stage_side.layer_end):
        raise LayoutMismatch(
            f"pool [{other.layer_start}, {other.layer_end}) lacks layers "
            f"[{stage_side.layer_start}, {stage_side.layer_end})"
        )
    if stage_side.hybrid or other.hybrid:
        return _start_hybrid(
            agent,
            op,
            remote_agent,
            notif,
            local_layout,
            local_pages,
            remote_layout,
            remote_pages,
            start,
            end,
            state_slots,
            state_layout,
        )
    layers = range(stage_side.layer_start, stage_side.layer_end)
    first = layers.start - local_layout.layer_start
    mine = list(local_layers[first : first + len(layers)])
    staging = None
    try:
        if start == end:  # nothing to move: the peer knows it too, so no notification
            return NixlTransfer(agent, 0)
        unpack = None
        runs_local_pages, runs_local_layout = local_pages, local_layout
        if local_layout.dtype != remote_layout.dtype or not local_layout.regions:
            count = end - start
            shape = (
                len(layers),
                1,
                local_layout.planes,
                count,
                local_layout.num_kv_heads,
                local_layout.head_dim,
            )
            dtype = torch_dtype(remote_layout.dtype)
            staging = agent.staging.acquire(shape, dtype, layer_device(mine[0]))
            if op == "WRITE":
                pack_staging(mine, local_pages, start, end, staging.tensor)
            else:
                unpack = (mine, local_pages, start, end)
            runs_local_layout = layout_of_tensors(layers.start, list(staging.tensor))
            runs_local_pages = staging_page_map(start, end)
        descs = _paged_descriptors(
            op, runs_local_layout, runs_local_pages, remote_layout, remote_pages, layers, start, end
        )
        mem_types = (runs_local_layout.mem_type, remote_layout.mem_type)
        transfer = _request(agent, op, remote_agent, notif, descs, mem_types, staging, unpack)
    except Exception as exc:
        if staging is not None:
            agent.staging.release(staging)
        reraise_as_transfer_error(op, remote_agent, exc)
    return post(agent, op, remote_agent, transfer)


def _paged_descriptors(
    op: str,
    local_layout: KVLayout,
    local_pages: PageMap,
    remote_layout: KVLayout,
    remote_pages: PageMap,
    layers: Sequence[int],
    start: int,
    end: int,
) -> Descriptors:
    """Descriptors of tokens ``[start, end)`` of ``layers``, source first (local for a
    WRITE, remote for a READ)."""
    if op == "WRITE":
        runs = token_runs(local_pages, remote_pages, start, end)
        return build_descriptors(runs, local_layout, remote_layout, layers, True)
    runs = token_runs(remote_pages, local_pages, start, end)
    return build_descriptors(runs, remote_layout, local_layout, layers, False)


def _request(
    agent: KVAgent,
    op: str,
    remote_agent: str,
    notif: bytes,
    descs: Descriptors,
    mem_types: tuple[str, str],
    staging: Staging | None = None,
    unpack: tuple | None = None,
) -> NixlTransfer:
    """The NIXL request (built, not posted) moving ``descs`` between memories of
    ``mem_types`` (local, remote)."""
    local = agent.nixl.get_xfer_descs(descs.local, mem_types[0])
    remote = agent.nixl.get_xfer_descs(descs.remote, mem_types[1])
    handle = agent.nixl.initialize_xfer(op, local, remote, remote_agent, notif)
    return NixlTransfer(agent, descs.num_bytes, handle, staging, unpack)


def reraise_as_transfer_error(op: str, remote_agent: str, exc: Exception) -> NoReturn:
    """Raise ``exc`` as a caller of a ``start_*`` function gets it: ours as they are, the
    nixl binding's (remote disconnected, bad descriptors) as TransferFailed."""
    if isinstance(exc, KVTransferError):
        raise exc
    raise TransferFailed(f"{op} to {remote_agent} failed: {exc!r}") from exc


def _start_hybrid(
    agent: KVAgent,
    op: str,
    remote_agent: str,
    notif: bytes,
    local_layout: KVLayout,
    local_pages: PageMap,
    remote_layout: KVLayout,
    remote_pages: PageMap,
    start: int,
    end: int,
    state_slots: tuple[int, int] | None,
    state_layout: KVLayout | None,
) -> NixlTransfer:
    """A pool with recurrent layers: the paged layers' token runs plus, with
    ``state_slots``, one slot per recurrent-state tensor, as ONE request (its notification
    follows all of it). Byte copies only: both pools registered, one dtype."""
    if local_layout.paged and not local_layout.regions:
        raise LayoutMismatch("a pool with recurrent layers must be registered with NIXL")
    if local_layout.dtype != remote_layout.dtype:
        raise LayoutMismatch(
            f"a pool with recurrent layers moves by byte copy only: dtypes {local_layout.dtype}"
            f" and {remote_layout.dtype} differ"
        )
    stage_side = local_layout if op == "WRITE" else remote_layout
    paged = stage_side.paged
    if start == end:
        return NixlTransfer(agent, 0)
    try:
        parts = [
            _paged_descriptors(
                op, local_layout, local_pages, remote_layout, remote_pages, paged, start, end
            )
        ]
        if state_slots is not None:
            whole = state_layout if op == "WRITE" and state_layout is not None else stage_side
            layers = range(whole.layer_start, whole.layer_end)
            src, dst = (whole, remote_layout) if op == "WRITE" else (remote_layout, local_layout)
            parts.append(state_descriptors(src, dst, layers, *state_slots, op == "WRITE"))
        descs = concat(*parts)
        if not len(descs.local):
            return NixlTransfer(agent, 0)  # e.g. a streamed range of a stage with no paged layer
        mem_types = (local_layout.mem_type, remote_layout.mem_type)
        transfer = _request(agent, op, remote_agent, notif, descs, mem_types)
    except Exception as exc:
        reraise_as_transfer_error(op, remote_agent, exc)
    return post(agent, op, remote_agent, transfer)


def post(agent: KVAgent, op: str, remote_agent: str, transfer: NixlTransfer) -> NixlTransfer:
    """Post ``transfer``'s request (built, not yet posted); on failure abort it (releasing
    its buffers)."""
    try:
        posted = agent.nixl.transfer(transfer._handle)
    except Exception as exc:
        transfer.abort()
        raise TransferFailed(f"posting a {op} to {remote_agent} failed: {exc!r}") from exc
    if posted == "ERR":
        transfer.abort()
        raise TransferFailed(f"NIXL refused to post a {op} to {remote_agent}")
    return transfer
