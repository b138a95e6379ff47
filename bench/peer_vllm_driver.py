"""bench/peer_vllm.py's vLLM side: one offline ``vllm.LLM`` in the PEER environment, driven
over stdin / stdout with one JSON object a line.

Runs with the peer env's python (scripts/setup_vllm_peer.sh) and imports nothing of ours. On
start it loads the model (prefix caching on, ``--mode eager`` = enforce_eager, ``compiled`` =
vLLM's default torch.compile) and, after a warm-up, prints ``{"ready": ...}``. Then for each
command line ``{"seed": [[ids], ...], "prompts": [[ids], ...]}`` it generates ``seed`` (untimed:
fills the prefix cache), then times ``llm.generate(prompts, max_tokens=1)`` and answers
``{"wall_s", "prompt_tokens", "cached_tokens", "first_tokens", "first_top"}`` (each
prompt's top-2 [token, logprob] pairs). EOF on stdin ends it.

vLLM's own logging and its child processes write to stderr: fd 1 is pointed at stderr before
vllm is imported, and the answers go to a private duplicate of the original stdout.

Threads: the parent sets VLLM_CPU_OMP_THREADS_BIND (the cores) and VLLM_CPU_KVCACHE_SPACE
(GiB of KV cache vLLM preallocates; keep it small on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def top2(logprobs: dict) -> list[list]:
    """One position's {token id: Logprob} as [[token, logprob], ...], best first, two."""
    pairs = sorted(((t, lp.logprob) for t, lp in logprobs.items()), key=lambda p: -p[1])
    return [[t, lp] for t, lp in pairs[:2]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    ap.add_argument("--mode", choices=("eager", "compiled"), required=True)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--memory-utilization",
        type=float,
        default=0.15,
        help="vLLM's gpu_memory_utilization, on CPU the share of RAM it requires free at start "
        "(its default 0.92 fails on a shared machine; the KV cache is VLLM_CPU_KVCACHE_SPACE)",
    )
    args = ap.parse_args()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=args.mode == "eager",
        enable_prefix_caching=True,
        max_model_len=args.max_model_len,
        seed=0,
        gpu_memory_utilization=args.memory_utilization,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)  # near-ties: see report

    def generate(prompts: list[list[int]]):
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return llm.generate(batch, params, use_tqdm=False)

    generate([[100 + i % 1000 for i in range(600)]])  # warm-up (not a prefix of any prompt)
    answers.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("seed"):
            generate(command["seed"])
        t = time.perf_counter()
        outputs = generate(command["prompts"])
        wall_s = time.perf_counter() - t
        answer = {
            "wall_s": wall_s,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "first_tokens": [o.outputs[0].token_ids[0] for o in outputs],
            "first_top": [top2(o.outputs[0].logprobs[0]) for o in outputs],
        }
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
