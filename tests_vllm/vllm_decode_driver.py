"""A stock vLLM decode instance with WavePPConnector, driven by JSON lines (the e2e test's peer).

Run with the vLLM peer environment's python and the checkout on PYTHONPATH::

    python tests_vllm/vllm_decode_driver.py MODEL_DIR [--failure-policy fail|recompute]

Prints ``{"ready": true, "block_size": N}`` once the engine is up; then, per stdin line
``{"prompt_ids": [...], "max_tokens": N, "kv_transfer_params": {...} | null}``, one stdout
line ``{"token_ids", "finish_reason", "num_cached_tokens", "kv_transfer_params"}`` (vLLM's
RequestOutput fields). vLLM's own log lines on stdout do not start with ``{``.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--failure-policy", default="fail", choices=("fail", "recompute"))
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        args.model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,  # a local hit shortens the READ (the test orders runs)
        max_model_len=2048,
        kv_transfer_config=KVTransferConfig(
            kv_connector="WavePPConnector",
            kv_connector_module_path="kv_transfer.vllm_decode.connector",
            kv_role="kv_consumer",
            kv_load_failure_policy=args.failure_policy,
            kv_connector_extra_config={"timeout_s": args.timeout},
        ),
    )
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    print(json.dumps({"ready": True, "block_size": block_size}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        extra = {}
        if job.get("kv_transfer_params") is not None:
            extra["kv_transfer_params"] = job["kv_transfer_params"]
        sampling = SamplingParams(
            temperature=0.0, max_tokens=job["max_tokens"], extra_args=extra or None
        )
        try:
            (out,) = llm.generate(
                TokensPrompt(prompt_token_ids=job["prompt_ids"]), sampling, use_tqdm=False
            )
            result = {
                "token_ids": list(out.outputs[0].token_ids),
                "finish_reason": out.outputs[0].finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
                "kv_transfer_params": out.kv_transfer_params,
            }
        except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
