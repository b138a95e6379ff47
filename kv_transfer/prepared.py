"""Prepared WRITEs: whole blocks between pools of one block size, from NIXL descriptor lists
prepared once per pool (``KVAgent.prepared_blocks``) and a request built from indices into
them (``make_prepped_xfer``), instead of descriptors computed per WRITE (plan.py, then
``get_xfer_descs`` / ``initialize_xfer``).

A prepared entry is a fixed byte range, here one block of one layer (its K and V pages
together). So only a range of whole blocks on both sides qualifies: same block size, range
ends on block bounds on both sides (decode's cached prefix a whole number of blocks), same
dtype, both pools registered, no recurrent layers. Anything else (a partial last block,
different block sizes or dtypes, a hybrid pool) goes the general way (transfer.py), which
also raises the errors for what cannot move at all.
"""

from __future__ import annotations

import numpy as np

from kv_transfer.agent import KVAgent
from kv_transfer.layout import KVLayout
from kv_transfer.plan import PageMap
from kv_transfer.transfer import NixlTransfer, post, reraise_as_transfer_error

# a pool whose layers x blocks exceed this is not prepared (NIXL holds one entry each)
MAX_PREPARED_ENTRIES = 1 << 20


def prepared_fits(
    local: KVLayout,
    remote: KVLayout,
    layers: tuple[int, int],
    src: PageMap,
    dst: PageMap,
    start: int,
    end: int,
) -> bool:
    """Whether WRITing tokens ``[start, end)`` of global ``layers`` can use prepared lists."""
    bs = local.block_size
    return (
        start < end
        and not (local.hybrid or remote.hybrid)
        and bool(local.regions and remote.regions)
        and (local.dtype, bs, local.planes, local.num_kv_heads, local.head_dim)
        == (remote.dtype, remote.block_size, remote.planes, remote.num_kv_heads, remote.head_dim)
        and local.mem_type == remote.mem_type
        and local.covers(*layers)
        and remote.covers(*layers)
        and src.block_size == bs == dst.block_size
        and (start - src.origin) % bs == 0
        and (end - src.origin) % bs == 0
        and (start - dst.origin) % bs == 0
        and max(local.num_layers * local.num_blocks, remote.num_layers * remote.num_blocks)
        <= MAX_PREPARED_ENTRIES
    )


def start_prepared_write(
    agent: KVAgent,
    remote_agent: str,
    notif: bytes,
    *,
    local_layout: KVLayout,
    layers: tuple[int, int],
    remote_layout: KVLayout,
    src: PageMap,
    dst: PageMap,
    start: int,
    end: int,
) -> NixlTransfer:
    """Post the WRITE of tokens ``[start, end)`` of global ``layers`` (``prepared_fits``)
    from ``local_layout`` (the whole registered pool) to ``remote_layout``, ``notif``
    delivered after it. Raises a KVTransferError subclass; never leaves a half-posted
    request."""
    src.check_range(start, end, "source")
    dst.check_range(start, end, "destination")
    bs = local_layout.block_size
    mine = src.ids[(start - src.origin) // bs : (end - src.origin) // bs]
    theirs = dst.ids[(start - dst.origin) // bs : (end - dst.origin) // bs]
    lo, hi = layers
    indices = []
    for layout, blocks in ((local_layout, mine), (remote_layout, theirs)):
        first = np.arange(lo - layout.layer_start, hi - layout.layer_start, dtype=np.int64)
        indices.append((first[:, None] * layout.num_blocks + blocks[None, :]).ravel())
    try:
        handle = agent.nixl.make_prepped_xfer(
            "WRITE",
            agent.prepared_blocks("", local_layout),
            indices[0].astype(np.int32),
            agent.prepared_blocks(remote_agent, remote_layout),
            indices[1].astype(np.int32),
            notif,
        )
    except Exception as exc:
        reraise_as_transfer_error("WRITE", remote_agent, exc)
    num_bytes = len(indices[0]) * local_layout.block_bytes
    return post(agent, "WRITE", remote_agent, NixlTransfer(agent, num_bytes, handle))
