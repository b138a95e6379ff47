"""`wavepp prefill`: prefill prompts on a model over an N-stage pipeline and print the results.

Prints, per prefill, the first generated token, cached vs computed tokens and timings; with
``--repeat 2`` (or prompts sharing a prefix) the later runs show the prefix reuse. Optional
``--generate N`` continues greedily by re-submitting prompt + answer, each step reusing the
cached prefix. The engine is built in ``_engine`` and used only through the Engine
protocol: the multi-process pipeline (default for N > 1), the in-process LocalEngine, or a
remote ``wavepp serve`` (``--server``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from prefill_node.cli.options import add_engine_arguments, engine_spec

DESCRIPTION = """\
Prefill one or more prompts on the default model (SmolLM2-135M-Instruct, converted from the
bundled GGUF on first use) or a Hugging Face checkpoint directory, with the model's layers
split over --stages pipeline stages, each with its own paged KV cache and prefix index. By
default each stage is its own OS process on torch.distributed (gloo on CPU, NCCL on CUDA);
--engine local simulates the stages in this process. Text prompts are wrapped in the
model's chat template unless --no-chat; --ids / --token-ids send raw token ids.

With --server HOST:PORT the prefills go to a running `wavepp serve` instead: text prompts
are sent AS TEXT and tokenised by the server with its model's tokenizer (and chat template,
with --system, unless --no-chat), so the client needs no model; token files and --ids are
sent as token ids. --model is then optional and only used to print token texts.

examples:
  wavepp prefill --stages 2 --repeat 2 "What is the capital of France?"
  wavepp prefill --stages 3 --generate 16 "Name three primary colours."
  wavepp prefill --ids 1,504,3458,314 --no-chat
  wavepp prefill --server 127.0.0.1:50051 --repeat 2 "What is the capital of France?"
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "prefill",
        help="prefill prompts on an N-stage pipeline, print the first token and cache reuse",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text(s), run in order")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ids", help="comma-separated token ids to prefill instead of text")
    src.add_argument(
        "--token-ids",
        type=Path,
        metavar="FILE",
        help="file of token ids (JSON list, or whitespace/comma separated) instead of text",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap text prompts in the model's chat template as one user turn, if the model has "
        "one (default: on; with --server the server applies it)",
    )
    p.add_argument("--system", help="system message for the chat template (with --chat)")
    p.add_argument("--repeat", type=int, default=1, help="run the prompt list K times (default 1)")
    p.add_argument("--cache-salt", help="isolate prefix reuse: only equal salts share KV")
    p.add_argument("--top-logprobs", type=int, default=5, help="alternatives to print (0-20)")
    p.add_argument(
        "--generate",
        "--max-new-tokens",
        dest="generate",
        type=int,
        default=0,
        metavar="N",
        help="after the prefill, continue greedily for up to N tokens and print the answer",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prefill")
    add_engine_arguments(
        p.add_argument_group("model and pipeline (without --server)"),
        stages=1,
        model_help="HF checkpoint dir (default: built-in SmolLM2); with --server optional, only "
        "used locally to print token texts",
        engine_help="pipeline: one OS process per stage on torch.distributed (the real "
        "runtime); local: all stages simulated in this process (default pipeline; 1 stage is "
        "always local)",
        policy_help="admission policy of the pipeline engine: wave (WavePP, admission ahead of "
        "execution), trtllm (the TensorRT-LLM PP baseline: stage 0 admits alone, the other "
        "stages follow) or sync-admission (an ablation: WavePP's cross-stage admission on "
        "stage 0's loop) (default wave)",
    )
    from prefill_node.client.remote_args import add_server_arguments

    add_server_arguments(p)  # --server HOST:PORT: run against `wavepp serve` (RemoteEngine)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from prefill_node.errors import InvalidRequestError, NeverFitsError, WaveppError

    try:
        return _run(args)
    except (InvalidRequestError, NeverFitsError) as exc:
        print(f"wavepp prefill: error: {exc}", file=sys.stderr)
        return 2
    except WaveppError as exc:
        print(f"wavepp prefill: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from prefill_node.engine.types import PrefillOptions

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    _check_args(args)
    t0 = time.monotonic()
    if args.server:
        engine, tokenizer, prompts, where = _remote(args)
    else:
        model_dir = _model_dir(args)
        tokenizer = _tokenizer(model_dir, required=not (args.ids or args.token_ids))
        prompts = _prompts(args, tokenizer)
        engine = _engine(args, model_dir)
        where = f"model {model_dir} | {args.stages} stage(s)"
    if not args.json:
        print(f"{where} | engine {_engine_kind(args)} | loaded in {time.monotonic() - t0:.1f}s")
    try:
        for rep in range(args.repeat):
            for i, prompt in enumerate(prompts):
                options = PrefillOptions(cache_salt=args.cache_salt, top_logprobs=args.top_logprobs)
                result, ids = _prefill(engine, prompt, options, args)
                label = f"run {rep + 1}.{i + 1}" if len(prompts) > 1 else f"run {rep + 1}"
                answer = _generate(engine, tokenizer, ids, result, args) if args.generate else None
                _report(label, result, tokenizer, answer, args.json)
    finally:
        engine.shutdown()
    return 0


def _remote(args: argparse.Namespace) -> tuple[Any, Any, list[Any], str]:
    """``--server``: the RemoteEngine, a tokenizer for printing token texts (only with
    --model), and the prompts: token-id lists, or the TEXT of text prompts, which the server
    tokenises (its tokenizer and chat template) - the client needs no model for that."""
    from prefill_node.errors import InvalidRequestError

    tokenizer = _tokenizer(args.model, required=False) if args.model is not None else None
    prompts: list[Any] = _prompts(args, None) if (args.ids or args.token_ids) else args.prompts
    engine = _engine(args, args.model)
    info = engine.info
    if args.prompts and not info.text_prompts:
        engine.shutdown()
        raise InvalidRequestError(
            f"the server at {args.server} has no tokenizer (its model directory has no "
            "tokenizer.json): send --ids or --token-ids instead of text"
        )
    where = f"server {args.server} | model {info.model_name} | {info.num_stages} stage(s)"
    return engine, tokenizer, prompts, where


def _prefill(engine: Any, prompt: Any, options: Any, args: argparse.Namespace):
    """One prefill -> (result, the prompt's token ids). Text (remote only) is sent as text:
    the server tokenises it, in its chat template with --chat when the model has one."""
    if isinstance(prompt, str):
        chat = args.chat and engine.info.chat_template
        system = (args.system or "") if chat else ""
        remote = engine.submit_text(prompt, options, chat=chat, system=system).result()
        return remote.result, list(remote.prompt_token_ids)
    return engine.submit(prompt, options).result(), prompt


def _engine_kind(args: argparse.Namespace) -> str:
    if args.server:
        return "remote (gRPC)"
    if args.engine == "pipeline" and args.stages > 1:
        return f"pipeline ({args.stages} processes, policy {args.policy})"
    return "local (in-process)"


def _check_args(args: argparse.Namespace) -> None:
    from prefill_node.errors import InvalidRequestError

    if args.stages < 1 or args.repeat < 1 or args.generate < 0:
        raise InvalidRequestError("--stages and --repeat must be >= 1, --generate >= 0")
    if not (args.prompts or args.ids or args.token_ids):
        raise InvalidRequestError("give a PROMPT, --ids or --token-ids")
    if args.prompts and (args.ids or args.token_ids):
        raise InvalidRequestError("give either PROMPT text or --ids/--token-ids, not both")


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    from prefill_node.model.default_model import default_model_dir

    return default_model_dir()


def _engine(args: argparse.Namespace, model_dir: Path | None) -> Any:
    """The Engine to run on: a RemoteEngine (--server), else what
    ``runtime.factory.build_engine`` builds (``model_dir`` is needed there)."""
    if args.server:  # remote mode: the same loop, every prefill a gRPC call
        from prefill_node.client.remote_args import remote_engine_from_args

        return remote_engine_from_args(args)
    if model_dir is None:
        from prefill_node.errors import InvariantError

        raise InvariantError("an engine needs a model directory without --server")
    from prefill_node.runtime.factory import build_engine

    return build_engine(engine_spec(args, model_dir), args.engine)


def _tokenizer(model_dir: Path, required: bool) -> Any:
    from prefill_node.errors import ModelFileNotFoundError
    from prefill_node.model.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(model_dir)
    except ModelFileNotFoundError:
        if required:
            raise
        return None


def _prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    if args.ids:
        return [_parse_ids(args.ids, "--ids")]
    if args.token_ids:
        text = args.token_ids.read_text()
        if text.lstrip().startswith("["):
            return [[int(x) for x in json.loads(text)]]
        return [_parse_ids(text.replace("\n", " ").replace(",", " "), str(args.token_ids))]
    out = []
    for prompt in args.prompts:
        if args.chat and tokenizer.has_chat_template:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": prompt})
            out.append(tokenizer.encode_chat(messages))
        else:
            out.append(tokenizer.encode(prompt))
    return out


def _parse_ids(text: str, where: str) -> list[int]:
    from prefill_node.errors import InvalidRequestError

    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise InvalidRequestError(f"{where}: token ids must be integers, got {text!r}") from None


def _generate(engine: Any, tokenizer: Any, ids: list[int], first: Any, args: argparse.Namespace):
    """Greedy continuation by re-prefilling prompt + answer (the cache keeps it cheap)."""
    from prefill_node.engine.types import PrefillOptions

    eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
    answer = [first.first_token_id]
    t0 = time.monotonic()
    while len(answer) < args.generate and answer[-1] not in eos:
        if len(ids) + len(answer) >= engine.max_model_len:
            break
        options = PrefillOptions(cache_salt=args.cache_salt, top_logprobs=0)
        answer.append(engine.submit(ids + answer, options).result().first_token_id)
    return answer, time.monotonic() - t0


def _text(tokenizer: Any, ids: list[int], skip_special: bool = False) -> str | None:
    return None if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=skip_special)


def _report(label: str, r: Any, tokenizer: Any, answer: Any, as_json: bool) -> None:
    t = r.timings
    if as_json:
        row = {
            "run": label,
            "request_id": r.request_id,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "computed_tokens": r.computed_tokens,
            "first_token_id": r.first_token_id,
            "first_token_text": _text(tokenizer, [r.first_token_id]),
            "top_logprobs": [list(x) for x in r.top_logprobs],
            "admission_s": t.admission_s,
            "compute_s": t.compute_s,
            "total_s": t.total_s,
        }
        if answer is not None:
            row.update(answer_ids=answer[0], answer_text=_text(tokenizer, answer[0], True))
            row["generate_s"] = answer[1]
        print(json.dumps(row))
        return
    print(
        f"[{label}] prompt {r.prompt_tokens} tokens | cached {r.cached_tokens} | "
        f"computed {r.computed_tokens} | admission {t.admission_s * 1e3:.1f} ms | "
        f"compute {t.compute_s * 1e3:.1f} ms | total {t.total_s * 1e3:.1f} ms"
    )
    first = _text(tokenizer, [r.first_token_id])
    print(f"  first token: {r.first_token_id}" + (f" {first!r}" if first is not None else ""))
    if r.top_logprobs:
        alts = ", ".join(
            (repr(_text(tokenizer, [i])) if tokenizer else str(i)) + f" {lp:.2f}"
            for i, lp in r.top_logprobs
        )
        print(f"  top logprobs: {alts}")
    if answer is not None:
        ids, seconds = answer
        text = _text(tokenizer, ids, skip_special=True)
        shown = repr(text) if text is not None else ",".join(map(str, ids))
        print(f"  answer ({len(ids)} tokens, {seconds:.2f}s): {shown}")
