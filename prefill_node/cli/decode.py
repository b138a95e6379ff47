"""`wavepp decode`: a full prefill -> NIXL -> decode round trip that streams generated text.

Local mode (default): this process runs a LocalEngine with ``--local-stages`` pipeline stages,
each with its own NIXL agent; a reference decode worker runs in a second process with its own
agent and KV pool. The prompt's KV travels over NIXL (push: the stages WRITE into blocks the
decode worker allocated; pull: the decode worker READs the leased blocks), then the decode
worker continues greedily with the same model and the text streams here.

Server mode (``--prefill-server HOST:PORT``): the decode worker runs in this process and asks
a running `wavepp serve` (KV hand-off is on by default there) to prefill over gRPC with a
push destination (the receiver's transfer id travels in ``KvPushDestination.transfer_id``) or,
with ``--mode pull``, READs the blocks named by the response's leased manifests.

``--serve``: the decode worker behind an OpenAI-compatible HTTP endpoint with vLLM's contract
(``decode.http_server``): a request's ``kv_transfer_params`` name the prefill stages' leased
blocks to READ, or the worker computes the prompt itself.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from prefill_node.cli.options import add_kv_progress

DESCRIPTION = """\
Prefill a prompt on a pipeline, ship its KV cache over NIXL to a reference decode worker
(another process), and stream the greedy continuation the decode worker generates from it.

examples:
  wavepp decode "What is the capital of France?"
  wavepp decode --local-stages 3 --mode pull --max-new-tokens 48 "Name three colours."
  wavepp decode --prefill-server 127.0.0.1:50051 "Hello"
  wavepp decode --model ./tiny --ids --no-chat "1,2,3,4,5"   # token ids in, ids out
  wavepp decode --serve --port 8000      # OpenAI-compatible HTTP decode server (as vllm serve)
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "decode",
        help="prefill -> NIXL KV hand-off -> reference decode worker; stream the answer",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text(s), run in order")
    p.add_argument("--model", type=Path, help="HF checkpoint dir (default: built-in SmolLM2)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--local-stages", type=int, default=2, help="stages of the in-process pipeline (default 2)"
    )
    where.add_argument("--prefill-server", metavar="HOST:PORT", help="use a running prefill node")
    p.add_argument("--mode", choices=("push", "pull"), default="push", help="KV hand-off mode")
    p.add_argument(
        "--ids",
        action="store_true",
        help="each PROMPT is comma-separated token ids; print the generated ids (no tokenizer)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap prompts in the model's chat template (default: on)",
    )
    p.add_argument("--block-size", type=int, default=16, help="prefill KV block size (default 16)")
    p.add_argument("--num-blocks", type=int, default=256, help="prefill KV blocks per stage")
    p.add_argument(
        "--decode-block-size", type=int, default=16, help="decode KV block size (default 16)"
    )
    p.add_argument("--decode-blocks", type=int, default=256, help="decode pool size in blocks")
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds a remote prefill may take, and again for its KV to arrive (default 30)",
    )
    add_kv_progress(p)
    s = p.add_argument_group("HTTP server (--serve)")
    s.add_argument(
        "--serve",
        action="store_true",
        help="serve OpenAI-compatible /v1/completions and /v1/chat/completions (no PROMPT)",
    )
    s.add_argument("--host", default="0.0.0.0", help="HTTP bind address (default 0.0.0.0)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port, 0 = any (default 8000)")
    s.add_argument("--served-model-name", help="the model's name in the API (default: its path)")
    s.add_argument(
        "--max-model-len",
        type=int,
        help="prompt + generated tokens per request (default: the model's, within the pool)",
    )
    s.add_argument(
        "--kv-load-failure-policy",
        choices=("recompute", "fail"),
        default="recompute",
        help="a failed KV load: compute the prompt here (default) or fail the request",
    )
    from prefill_node.cli.options import add_tracing_argument

    add_tracing_argument(s)
    s.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from prefill_node.errors import WaveppError

    try:
        if args.serve:
            if args.prompts:
                raise ValueError("--serve takes no PROMPT: send requests over HTTP")
            from prefill_node.cli.decode_serve import run_serve
            from prefill_node.cli.options import configure_tracing

            configure_tracing(args, "wavepp-decode")
            return run_serve(args, _model_dir(args))
        if not args.prompts:
            raise ValueError("give at least one PROMPT (or --serve)")
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        return _run_server(args) if args.prefill_server else _run_local(args)
    except (WaveppError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:  # the prefill server's status, e.g. the hand-off turned off
        print(f"error: prefill server: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    from prefill_node.model.default_model import default_model_dir

    return default_model_dir()


def _tokenizer(args: argparse.Namespace, model_dir: Path) -> Any:
    if args.ids:
        return None
    from prefill_node.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def _encode(args: argparse.Namespace, tokenizer: Any, text: str) -> list[int]:
    if tokenizer is None:
        try:
            ids = [int(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"--ids: {text!r} is not comma-separated token ids") from None
        if not ids or min(ids) < 0:
            raise ValueError(f"--ids: {text!r} must hold non-negative token ids")
        return ids
    if args.chat and tokenizer.has_chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": text}])
    return tokenizer.encode(text)


def _stream(tokenizer: Any, tokens: Any) -> list[int]:
    """Print the text of ``tokens`` as they arrive (decoding the whole answer each time, so
    multi-token characters come out whole); the token ids. No tokenizer: one line of ids."""
    answer: list[int] = []
    if tokenizer is None:
        answer = list(tokens)
        print(",".join(map(str, answer)), flush=True)
        return answer
    shown = ""
    for token in tokens:
        answer.append(token)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        if text.startswith(shown):
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return answer


def worker_spec(args: argparse.Namespace, model_dir: Path) -> Any:
    """The decode worker process's DecodeWorkerSpec from the flags (both modes)."""
    from prefill_node.decode.worker_process import DecodeWorkerSpec

    return DecodeWorkerSpec(
        model_dir=str(model_dir),
        num_blocks=args.decode_blocks,
        block_size=args.decode_block_size,
        timeout_s=args.timeout,
        kv_progress=args.kv_progress,
    )


def _run_local(args: argparse.Namespace) -> int:
    from prefill_node.decode.worker_process import DecodeWorkerProcess
    from prefill_node.engine.types import KVPullDestination, PrefillOptions
    from prefill_node.kv_handoff.config import KVHandoffConfig
    from prefill_node.runtime.engine_config import EngineConfig
    from prefill_node.runtime.local_engine import LocalEngine

    model_dir = _model_dir(args)
    tokenizer = _tokenizer(args, model_dir)
    spec = worker_spec(args, model_dir)
    handoff = KVHandoffConfig(transfer_timeout_s=args.timeout, progress=args.kv_progress)
    with DecodeWorkerProcess(spec) as decode:  # loads its model while we load ours
        config = EngineConfig(
            model_dir=model_dir,
            stages=args.local_stages,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            kv_handoff=handoff,
        )
        engine = LocalEngine.from_model_dir(config)
        try:
            for text in args.prompts:
                ids = _encode(args, tokenizer, text)
                request_id = uuid.uuid4().hex[:12]
                started = time.monotonic()
                if args.mode == "push":
                    dest: Any = decode.expect_push(request_id, ids)
                else:
                    dest = KVPullDestination()
                result = engine.submit(ids, PrefillOptions(request_id, kv_destination=dest))
                prefill = result.result()
                prefilled = time.monotonic()
                if args.mode == "pull":
                    decode.pull(request_id, ids, prefill.stage_manifests)
                tokens = decode.generate(
                    request_id,
                    prefill.first_token_id,
                    args.max_new_tokens,
                    tokenizer.eos_token_ids if tokenizer else (),
                )
                answer = _stream(tokenizer, tokens)
                _summary(args, ids, prefill, started, prefilled, decode.kv_wait_s, answer)
        finally:
            engine.shutdown()
    return 0


def _summary(args, ids, prefill, started, prefilled, kv_wait_s, answer) -> None:
    total = time.monotonic() - started
    stages = len(prefill.stage_manifests)
    where = f" (pipeline {prefill.served_by})" if prefill.served_by else ""
    print(
        f"[{args.mode}] prompt {len(ids)} tokens ({prefill.cached_tokens} cached), "
        f"prefill {prefilled - started:.3f}s on {stages} stages{where}, KV ready on decode after "
        f"{kv_wait_s * 1000:.1f} ms more, {len(answer)} tokens in {total:.2f}s",
        file=sys.stderr,
    )


def _run_server(args: argparse.Namespace) -> int:
    from kv_transfer.receiver import ReceiverConfig
    from prefill_node.client.prefill_client import PrefillClient
    from prefill_node.decode.decode_worker import DecodeWorker
    from prefill_node.engine.types import KVPullDestination

    model_dir = _model_dir(args)
    tokenizer = _tokenizer(args, model_dir)
    worker = DecodeWorker.from_model_dir(
        model_dir,
        num_blocks=args.decode_blocks,
        block_size=args.decode_block_size,
        receiver_config=ReceiverConfig(timeout_s=args.timeout),
        kv_progress=args.kv_progress,
    )
    try:
        with PrefillClient(args.prefill_server) as client:
            for text in args.prompts:
                ids = _encode(args, tokenizer, text)
                request_id = uuid.uuid4().hex[:12]
                started = time.monotonic()
                if args.mode == "push":  # received within the prefill's deadline + --timeout
                    dest: Any = worker.expect_push(request_id, ids, timeout_s=2 * args.timeout)
                else:
                    dest = KVPullDestination()
                try:
                    remote = client.prefill(
                        ids, request_id=request_id, kv_destination=dest, deadline_s=args.timeout
                    )
                except BaseException:
                    if args.mode == "push":
                        worker.release(request_id)
                    raise
                prefilled = time.monotonic()
                if args.mode == "pull":
                    worker.pull(request_id, ids, remote.result.stage_manifests)
                worker.wait_kv(request_id, args.timeout)
                kv_wait = time.monotonic() - prefilled
                tokens = worker.generate(
                    request_id,
                    remote.result.first_token_id,
                    args.max_new_tokens,
                    tokenizer.eos_token_ids if tokenizer else (),
                )
                answer = _stream(tokenizer, tokens)
                worker.release(request_id)
                _summary(args, ids, remote.result, started, prefilled, kv_wait, answer)
    finally:
        worker.close()
    return 0
