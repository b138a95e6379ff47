"""`wavepp decode --serve`: the reference decode worker as an OpenAI-compatible HTTP server.

Builds the engine (model, KV pool, NIXL agent) first, then binds the socket, prints
``wavepp decode: listening on HOST:PORT`` (the line scripts and tests wait for) and serves
with uvicorn until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path


def run_serve(args: argparse.Namespace, model_dir: Path) -> int:
    import uvicorn

    from prefill_node.cli.decode import worker_spec
    from prefill_node.decode.decode_engine import DecodeEngine, KVLoadFailurePolicy
    from prefill_node.decode.http_server import ServedModel, build_app
    from prefill_node.decode.metrics import decode_registry
    from prefill_node.decode.openai_protocol import PromptLimits
    from prefill_node.model.loader_hf import load_hf_config
    from prefill_node.model.tokenizer import Tokenizer
    from prefill_node.openai_api.listener import tcp_listener

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = load_hf_config(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    pool_tokens = args.decode_blocks * args.decode_block_size
    max_len = min(config.max_position_embeddings, pool_tokens)
    if args.max_model_len is not None:
        if args.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2")
        max_len = min(max_len, args.max_model_len)
    spec = worker_spec(args, model_dir)
    engine = DecodeEngine(spec, KVLoadFailurePolicy(args.kv_load_failure_policy))
    engine.start()
    try:
        name = args.served_model_name or str(args.model or model_dir)
        limits = PromptLimits(config.vocab_size, max_len)
        model = ServedModel(name, tokenizer, limits, str(model_dir))
        app = build_app(engine, model, decode_registry(engine, name))
        sock = tcp_listener(args.host, args.port)
        port = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(
                app, log_level=args.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=5,
            )
        )  # fmt: skip
        # uvicorn re-raises the signal that stopped it once its own handlers are gone; with
        # these in place that ends here, and a drained server exits 0 (as `wavepp serve`)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        print(f"wavepp decode: listening on {args.host}:{port}", flush=True)
        server.run(sockets=[sock])
    finally:
        engine.stop()
    return 0
