"""What each modelled TensorRT-LLM loop mechanism costs the trtllm baseline, one at a time.

Runs one setting (default: suffix4k, c=128, each GPU preset, 131,072 tokens) under
trtllm with the TensorRT-LLM loop costs switched on cumulatively, then wave once, and
prints throughput and the wave/baseline ratio per step (trtllm_costs.py has the sources):

  walks        scheduler walks + add_sequence only (TrtllmLoopCosts(), the old model)
  +walk base   every walk also pays its per-prompt-token base
  +prompts     pickling / unpickling / list conversions of new and scheduled prompts
  +retire      the two walks per prompt when a request retires
  +blocking    the request forward blocks until the next rank's loop posts its receive
               (= TRTLLM_PP_MEASURED, what the GPU presets use)

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python bench/trtllm_ablation.py --json out.json

The simulator is deterministic: one run per step is its value.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from tqdm import tqdm

from prefill_node.core.policy import trtllm_policy, wave_policy
from prefill_node.sim.presets import Preset, get_preset
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.sweep import default_requests
from prefill_node.sim.trtllm_costs import TRTLLM_PP_MEASURED, TrtllmLoopCosts
from prefill_node.sim.workloads import WorkloadKind, WorkloadSpec


def steps() -> list[tuple[str, TrtllmLoopCosts]]:
    m = TRTLLM_PP_MEASURED
    base = TrtllmLoopCosts(walk_base_s_per_token=m.walk_base_s_per_token)
    prompts = replace(
        base,
        send_s_per_token=m.send_s_per_token,
        recv_s_per_token=m.recv_s_per_token,
        merge_s_per_token=m.merge_s_per_token,
        prepare_s_per_token=m.prepare_s_per_token,
    )
    retire = replace(prompts, retire_walks=m.retire_walks)
    return [
        ("walks", TrtllmLoopCosts()),
        ("+walk base", base),
        ("+prompts", prompts),
        ("+retire", retire),
        ("+blocking", replace(retire, blocking_request_send=True)),
    ]


def faster_host(preset: Preset, speedup: float) -> Preset:
    """``preset`` with every host cost of both policies divided by ``speedup`` (its
    ``host_time_scale``: the trtllm loops' walks, add_sequence and prompt moves, wave's
    loop work, and the rounds' host work; counts such as ``retire_walks`` and the
    blocking-send switch are kept)."""
    return replace(preset, host_time_scale=preset.host_time_scale / speedup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", default=["glm5-pp4", "minimax-pp4"])
    parser.add_argument("--workload", default="suffix4k", choices=[k.value for k in WorkloadKind])
    parser.add_argument("--input-len", type=int, default=131_072)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument(
        "--host-speedup",
        type=float,
        default=1.0,
        help="divide every host cost of both policies (the preset's host_time_scale) by this:\n"
        "both on a host this much faster than the VM the costs were measured on",
    )
    args = parser.parse_args()
    if args.host_speedup <= 0:
        parser.error("--host-speedup must be > 0")
    rows = []
    jobs = [(name, label, costs) for name in args.preset for label, costs in steps()]
    jobs += [(name, "wave", None) for name in args.preset]
    for name, label, costs in tqdm(jobs, desc="simulating", unit="run"):
        preset = get_preset(name)
        spec = WorkloadSpec(
            WorkloadKind(args.workload),
            args.input_len,
            args.concurrency,
            default_requests(args.concurrency),
            preset.block_size,
        )
        if costs is None:
            policy = wave_policy(preset.num_stages)
        else:
            preset, policy = replace(preset, trtllm=costs), trtllm_policy(preset.num_stages)
        preset = faster_host(preset, args.host_speedup)  # both policies' host work
        res = Simulator(preset, spec, policy).run()
        rows.append({"step": label, **res.row()})
    for name in args.preset:
        wave = next(r for r in rows if r["preset"] == name and r["step"] == "wave")
        print(f"{name} {args.workload} {args.input_len} c={args.concurrency}:")
        for r in rows:
            if r["preset"] == name and r["step"] != "wave":
                tps = r["throughput_tok_s"]
                ratio = wave["throughput_tok_s"] / tps
                print(f"  {r['step']:<11} trtllm {tps:>12,.0f} tok/s  {ratio:.2f}x")
        print(f"  {'wave':<11}          {wave['throughput_tok_s']:>12,.0f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
