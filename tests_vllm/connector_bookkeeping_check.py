"""Peer-environment side of test_vllm_connector_bookkeeping: WavePPConnector's scheduler side
with stand-in requests (vLLM's real config and connector classes), exits non-zero on failure.

Run with the vLLM peer environment's python and the checkout on PYTHONPATH.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kv_transfer.vllm_decode.connector import WavePPConnector, _Loaded
from kv_transfer.vllm_decode.params import (
    LOADED_KEY,
    PROMPT_KEY,
    PULL_KEY,
    LoadReport,
    prompt_digest,
)

PROMPT = list(range(40))


def _request(request_id: str) -> SimpleNamespace:
    params = {PULL_KEY: [{"stage": 0}], PROMPT_KEY: prompt_digest(PROMPT)}
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params=params,
        num_prompt_tokens=len(PROMPT),
        prompt_token_ids=PROMPT,
    )


def _plan(connector: WavePPConnector, request: SimpleNamespace) -> None:
    count, is_async = connector.get_num_new_matched_tokens(request, 0)
    assert (count, is_async) == (len(PROMPT), True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([0],))
    connector.update_state_after_alloc(request, blocks, count)
    (load,) = connector.build_connector_meta(None).loads
    assert load.request_id == request.request_id and load.refused is None


def _report(connector: WavePPConnector, request_id: str, report: LoadReport) -> None:
    meta = _Loaded({request_id: report})
    connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))


def main() -> None:
    config = KVTransferConfig(
        kv_connector="WavePPConnector",
        kv_role="kv_consumer",
        kv_connector_module_path="kv_transfer.vllm_decode.connector",
    )
    connector = WavePPConnector(
        SimpleNamespace(kv_transfer_config=config), KVConnectorRole.SCHEDULER
    )
    # a load that ends, then its request: the report reaches the answer
    done = _request("done")
    _plan(connector, done)
    _report(connector, "done", LoadReport(40, 1000))
    assert connector.request_finished(done, []) == (
        False,
        {LOADED_KEY: {"tokens": 40, "bytes": 1000, "ok": True, "error": None}},
    )
    # a request that finishes (aborted) while its load runs: its answer says so, and the
    # load's report arriving afterwards is dropped, not kept for a request that is gone
    gone = _request("gone")
    _plan(connector, gone)
    delay, params = connector.request_finished(gone, [])
    assert delay is False and params[LOADED_KEY]["ok"] is False, params
    assert "finished before its load" in params[LOADED_KEY]["error"]
    _report(connector, "gone", LoadReport(40, 1000))
    assert connector._loaded == {} and connector._planned == set(), (
        connector._loaded,
        connector._planned,
    )
    print("ok", flush=True)


if __name__ == "__main__":
    main()
