"""KVAgent: one NIXL agent (UCX backend) per process, with its KV pool registered once."""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kv_transfer.errors import InvalidTransferRequest, TransferFailed
from kv_transfer.layout import HybridPool, KVLayout, layout_of_tensors
from kv_transfer.progress import EVENT_WAKEUP_US, KVProgress
from kv_transfer.staging import StagingPool

log = logging.getLogger(__name__)


class KVAgent:
    """Owns a ``nixl_agent`` and what it registered.

    Threading contract: NIXL is created without a listener thread (sync mode NONE), so every
    method must be called from one thread (the owner's loop). ``metadata`` is a cached
    bytes snapshot, safe to hand to another thread (the metadata endpoint serves it).

    Progress: see ``KVProgress``. Measured limit of ``OWNER``: a standalone notification
    (a stage with no tokens to send) on a connection that never carried a transfer stays
    queued, so senders keep a progress thread (``EVENT`` costs nothing at idle).
    """

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        progress: KVProgress = KVProgress.EVENT,
    ):
        _nixl_logs_to_stderr()
        if not name:
            raise InvalidTransferRequest("a NIXL agent needs a non-empty unique name")
        self.name = name
        self.progress = KVProgress(progress)
        self.nixl = _make_nixl_agent(name, backends, num_threads, self.progress)
        missing = [b for b in backends if b not in self.nixl.backends]
        if missing:
            raise TransferFailed(f"NIXL backends {missing} unavailable on agent {name}")
        self._registrations: list[Any] = []
        self._remote_digests: dict[str, bytes] = {}
        self._parked: list[Any] = []
        self._prepared: dict[str, tuple[KVLayout, Any]] = {}  # "" (ours) or a peer's name
        self.metadata = self.nixl.get_agent_metadata()
        self.staging = StagingPool(self.nixl.register_memory, self.nixl.deregister_memory)

    def register_kv(
        self,
        layer_start: int,
        kv_caches: Sequence[torch.Tensor],
        hybrid: HybridPool | None = None,
    ) -> KVLayout:
        """Register one pool's per-layer tensors (and a ``hybrid`` pool's recurrent-state
        tensors); they must stay alive until ``close``."""
        if hybrid is None:
            layout = layout_of_tensors(layer_start, kv_caches)
        else:
            layout = hybrid.layout(layer_start, kv_caches)
        tensors = [*kv_caches, *(hybrid.tensors() if hybrid is not None else ())]
        self._registrations.append(self.nixl.register_memory(tensors))
        self.metadata = self.nixl.get_agent_metadata()
        return layout

    def register_scratch(self, tensor: torch.Tensor) -> Any:
        """Register a local-only tensor (peers never address it: no metadata refresh);
        pass the result to ``deregister``."""
        return self.nixl.register_memory(tensor)

    def deregister(self, registration: Any) -> None:
        self.nixl.deregister_memory(registration)

    def prepared_blocks(self, name: str, layout: KVLayout) -> Any:
        """A NIXL descriptor list of every block of every layer of ``layout`` (entry
        ``i * num_blocks + b``: the layer at ``layer_start + i``, block ``b``, its K and V
        pages as one piece), prepared once: this agent's own pool (``name`` "") or loaded
        peer ``name``'s. Released when the peer is forgotten or the agent closes."""
        held = self._prepared.get(name)
        if held is not None and (held[0] is layout or held[0] == layout):
            return held[1]
        self._release_prepared(name)
        rows = np.array(  # strided: (address, length, device, stride, count) per layer
            [[r.base_addr, layout.block_bytes, r.device_id, layout.block_bytes, layout.num_blocks]
             for r in layout.regions],
            dtype=np.uint64,
        )  # fmt: skip
        handle = self.nixl.prep_xfer_dlist(name or "NIXL_INIT_AGENT", rows, layout.mem_type)
        self._prepared[name] = (layout, handle)
        return handle

    def _release_prepared(self, name: str) -> None:
        held = self._prepared.pop(name, None)
        if held is not None:
            held[1].release()

    def park(self, resources: Any) -> None:
        """Keep buffers of a transfer NIXL could not cancel alive until ``close``."""
        self._parked.append(resources)

    def load_remote(self, name: str, metadata: bytes) -> None:
        """Load peer ``name``'s metadata (idempotent); a changed blob for ``name`` reloads it
        (the peer restarted)."""
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        if self._remote_digests.get(name) == digest:
            return
        self.forget_remote(name)
        try:
            loaded = self.nixl.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferFailed(f"cannot load NIXL metadata of {name}: {exc!r}") from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self.nixl.remove_remote_agent(loaded)
            raise TransferFailed(f"peer announced agent {name!r} but its metadata is {loaded!r}")
        self._remote_digests[name] = digest
        try:  # connect eagerly: the first transfer then skips the wire-up
            self.nixl.make_connection(name)
        except Exception as exc:
            self.forget_remote(name)
            raise TransferFailed(f"cannot connect to NIXL agent {name}: {exc!r}") from exc

    def forget_remote(self, name: str) -> None:
        self._release_prepared(name)  # before NIXL drops the peer it refers to
        if self._remote_digests.pop(name, None) is not None:
            try:
                self.nixl.remove_remote_agent(name)
            except Exception as exc:  # a dead peer may already be invalidated
                log.debug("removing remote agent %s: %r", name, exc)

    def knows(self, name: str) -> bool:
        return name in self._remote_digests

    def close(self) -> None:
        self.staging.close()
        for name in list(self._remote_digests):
            self.forget_remote(name)
        for name in list(self._prepared):
            self._release_prepared(name)
        for registration in self._registrations:
            self.nixl.deregister_memory(registration)
        self._registrations.clear()


def _make_nixl_agent(
    name: str, backends: Sequence[str], num_threads: int, progress: KVProgress
) -> Any:
    """A ``nixl_agent`` whose progress thread follows ``progress``.

    nixl's Python wrapper hard-codes the progress thread's poll timeout to 0 (a busy loop)
    and takes no option for it, so the wrapper is built without backends, its native agent
    is replaced by one made from our ``nixlAgentConfig``, and the backends are created
    through the wrapper as usual (they read the delay from the native agent at creation).
    """
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    wrapper = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    bindings = sys.modules[nixl_agent.__module__].nixlBind
    config = bindings.nixlAgentConfig()
    config.useProgThread = progress is not KVProgress.OWNER
    config.useListenThread = False
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
    config.pthrDelay = EVENT_WAKEUP_US if progress is KVProgress.EVENT else 0
    wrapper.agent = bindings.nixlAgent(name, config)
    init = {"num_threads": str(num_threads)} if num_threads > 0 else {}
    for backend in backends:
        if backend in wrapper.plugin_list:
            wrapper.create_backend(backend, dict(init))
    return wrapper


def _nixl_logs_to_stderr() -> None:
    """NIXL's own log handler writes to stdout; CLIs here print results there (``--ids``,
    ``--json``), so its records go to stderr instead (nixl adds its handler on import)."""
    import nixl._api  # noqa: F401

    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
