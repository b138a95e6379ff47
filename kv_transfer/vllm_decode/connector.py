"""WavePPConnector: vLLM's KV connector API over our pull hand-off (kv_transfer.KVReceiver).

Load it in a stock vLLM decode instance::

    KVTransferConfig(kv_connector="WavePPConnector", kv_role="kv_consumer",
                     kv_connector_module_path="kv_transfer.vllm_decode.connector")

A request whose ``kv_transfer_params`` carry ``params.pull_params(manifests)`` (the prefill
response's leased stage manifests) gets its prompt's KV READ from every prefill stage over
NIXL into vLLM's paged CPU cache (staged: the cache is head-major, see ``cache``), reported
to vLLM as computed so it only recomputes the last prompt token (which it does for any full
prompt hit, to sample the next token). Scheduler side: ``get_num_new_matched_tokens`` claims
``prompt - locally cached`` tokens, loaded asynchronously; ``update_state_after_alloc`` notes
the blocks vLLM gave them; ``build_connector_meta`` hands the loads to the worker side. Worker
side: ``start_load_kv`` starts the READs, ``get_transfer_results`` polls them (heartbeating
the leases) and reports each request done or failed. A failed load (a malformed manifest, a
lease gone, a stage dead, a timeout) is reported in ``failed_recving``: vLLM then applies its
``kv_load_failure_policy`` ("fail": the request ends with an error; "recompute": it computes
the prompt itself). Blocks of a failed load are never reported as loaded. Each finished
request's ``RequestOutput.kv_transfer_params`` says what came over NIXL (``params``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_transfer.agent import KVAgent
from kv_transfer.errors import InvalidTransferRequest, KVTransferError, LayoutMismatch
from kv_transfer.load_trace import end_load, start_load
from kv_transfer.receiver import KVReceiver, ReceiverConfig
from kv_transfer.vllm_decode.cache import SUPPORTED_ISAS, pool_views
from kv_transfer.vllm_decode.params import (
    LOADED_KEY,
    PULL_KEY,
    TRACE_KEY,
    LoadReport,
    prompt_mismatch,
    prompt_tokens,
    pull_manifests,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = init_logger(__name__)
_SEEN = "_wavepp_seen"  # set in a request's params once its load was planned (at most once)


@dataclass(frozen=True)
class _Load:
    request_id: str
    raw: dict[str, Any]  # the request's kv_transfer_params (manifests parsed on the worker)
    block_ids: tuple[int, ...]  # vLLM blocks of the whole request, from token 0
    skip_tokens: int  # locally cached prefix: not read
    num_tokens: int  # the prompt's length in vLLM
    refused: str | None = None  # why this load must fail (found on the scheduler side)


@dataclass
class _Meta(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


@dataclass
class _Loaded(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per finished load, tokens and bytes READ and the error if any."""

    by_request: dict[str, LoadReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, _Loaded)
        return _Loaded({**self.by_request, **other.by_request})


class WavePPConnector(KVConnectorBase_V1):
    """Decode-side (``kv_consumer``) connector; extra config: ``timeout_s`` (per load, 30)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._timeout_s = float(extra.get("timeout_s", 30.0))
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise InvalidTransferRequest(
                "WavePPConnector supports models with one KV cache group (full attention)"
            )
        # scheduler side
        self._to_load: list[_Load] = []
        self._planned: set[str] = set()  # loads handed to the worker, not reported back yet
        self._loaded: dict[str, LoadReport] = {}  # reported, for request_finished
        # worker side
        self._receiver: KVReceiver | None = None
        self._live: dict[str, int] = {}  # request id -> tokens being read
        self._spans: dict[str, Any] = {}  # request id -> its traced load's span (load_trace)
        self._ended: dict[str, LoadReport] = {}  # finished since the last report
        self._report: dict[str, LoadReport] = {}  # for build_connector_worker_meta

    # ================================================================ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or PULL_KEY not in params or params.get(_SEEN):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or PULL_KEY not in params or params.get(_SEEN):
            return
        params[_SEEN] = True  # one load per request: a preempted one recomputes
        if num_external_tokens <= 0:
            return
        self._planned.add(request.request_id)
        self._to_load.append(
            _Load(
                request.request_id,
                {PULL_KEY: params[PULL_KEY], TRACE_KEY: params.get(TRACE_KEY)},
                tuple(blocks.get_block_ids()[0]),
                request.num_prompt_tokens - num_external_tokens,
                request.num_prompt_tokens,
                prompt_mismatch(params, request.prompt_token_ids or ()),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._to_load = _Meta(self._to_load), []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, _Loaded):
            for request_id, report in meta.by_request.items():
                if request_id in self._planned:  # else its request finished first: drop it
                    self._planned.discard(request_id)
                    self._loaded[request_id] = report

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        loaded = self._loaded.pop(request.request_id, None)
        if loaded is None and not (request.kv_transfer_params or {}).get(PULL_KEY):
            return False, None
        if loaded is None and request.request_id in self._planned:
            # finished (aborted: a client gone) while its load runs; vLLM keeps the blocks
            # until the worker reports the load, whose report is then dropped
            self._planned.discard(request.request_id)
            loaded = LoadReport(0, 0, "the request finished before its load did")
        elif loaded is None:
            loaded = LoadReport(0, 0, "nothing loaded: no load was planned for this request")
        return False, {LOADED_KEY: loaded.to_dict()}

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self._vllm_config.model_config
        first = next(iter(kv_caches.values()))
        isa = _attention_isa(first, model.get_head_size(), self._vllm_config)
        if first.device.type != "cpu" or isa not in SUPPORTED_ISAS:
            raise LayoutMismatch(
                f"WavePPConnector knows vLLM's CPU cache layout of the {SUPPORTED_ISAS} "
                f"attention kernels; this instance uses {first.device.type} / {isa!r}"
            )
        views = pool_views(
            kv_caches,
            model.get_num_kv_heads(self._vllm_config.parallel_config),
            model.get_head_size(),
        )
        agent = KVAgent(f"wavepp-vllm-{uuid.uuid4().hex[:8]}")
        self._receiver = KVReceiver(
            agent, views, ReceiverConfig(timeout_s=self._timeout_s), registered=False
        )
        # vLLM's own allocator owns every block; the receiver only checks ids are in range
        self._receiver.allocate(self._receiver.layout.num_blocks)
        log.info(
            "WavePPConnector: vLLM pool of %d layers, each %s (strides %s), %d blocks of %d "
            "tokens; READs are staged and copied in",
            len(views),
            tuple(first.shape),
            first.stride(),
            self._receiver.layout.num_blocks,
            self._receiver.layout.block_size,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for load in meta.loads:
            try:
                self._start(load)
            except KVTransferError as exc:
                self._end(load.request_id, 0, 0, exc)

    def _start(self, load: _Load) -> None:
        if load.refused is not None:
            raise InvalidTransferRequest(load.refused)
        if self._receiver is None:
            raise InvalidTransferRequest("no KV cache registered with the connector")
        manifests = pull_manifests(load.raw, load.request_id) or []
        if prompt_tokens(manifests) != load.num_tokens:
            raise InvalidTransferRequest(
                f"the stages hold {prompt_tokens(manifests)} tokens, vLLM's prompt has "
                f"{load.num_tokens}: send the prompt the prefill tier computed"
            )
        block_size = self._receiver.layout.block_size
        if load.skip_tokens % block_size:
            raise InvalidTransferRequest(f"cached prefix {load.skip_tokens} is not whole blocks")
        first = load.skip_tokens // block_size
        self._receiver.pull(manifests, load.block_ids[first:], load.skip_tokens)
        self._live[load.request_id] = load.num_tokens - load.skip_tokens
        traceparent = load.raw.get(TRACE_KEY)
        if traceparent:  # the gateway traces this request: so does its load
            num_tokens = load.num_tokens - load.skip_tokens
            self._spans[load.request_id] = start_load(traceparent, load.request_id, num_tokens)

    def _end(self, request_id: str, tokens: int, num_bytes: int, error: Exception | None) -> None:
        self._live.pop(request_id, None)
        ok = error is None
        if self._spans:
            span = self._spans.pop(request_id, None)
            end_load(span, num_bytes, None if ok else f"{type(error).__name__}: {error}")
        if ok:
            log.info(
                "WavePPConnector: %s loaded %d tokens, %d bytes", request_id, tokens, num_bytes
            )
        else:
            log.warning("WavePPConnector: loading KV of %s failed: %s", request_id, error)
        self._ended[request_id] = (
            LoadReport(tokens, num_bytes)
            if ok
            else LoadReport(0, num_bytes, f"{type(error).__name__}: {error}")
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (async): nothing is read mid-forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # a consumer saves nothing

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._receiver is not None and self._receiver.busy:
            for outcome in self._receiver.poll():
                tokens = self._live.get(outcome.request_id, 0)
                self._end(outcome.request_id, tokens, outcome.num_bytes, outcome.error)
        done, self._ended = self._ended, {}
        self._report.update(done)
        failed = {rid for rid, report in done.items() if not report.ok}
        return KVConnectorTransferResults(finished_recving=set(done), failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._report:
            return None
        meta, self._report = _Loaded(self._report), {}
        return meta

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None


def _attention_isa(cache: torch.Tensor, head_size: int, vllm_config: VllmConfig) -> str:
    """The CPU attention kernel family vLLM picks for this cache (it fixes the layout)."""
    if cache.device.type != "cpu":
        return "none"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(
        cache.dtype, cache.shape[2], head_size, vllm_config.cache_config.cache_dtype
    )
