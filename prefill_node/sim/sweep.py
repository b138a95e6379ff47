"""Settings grids for the simulator (the paper's grid and user lists) and one run per setting."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefill_node.core.planner import PlannerMode
from prefill_node.core.policy import Policy, sync_admission_policy, trtllm_policy, wave_policy
from prefill_node.sim.presets import Preset
from prefill_node.sim.results import SimResult
from prefill_node.sim.simulator import Simulator
from prefill_node.sim.workloads import WorkloadKind, WorkloadSpec

PAPER_CONCURRENCY = (1, 8, 32, 128)


@dataclass(frozen=True)
class Setting:
    """One point of a sweep: a preset, a workload at one length and one concurrency."""

    preset: Preset
    kind: WorkloadKind
    input_len: int
    concurrency: int
    num_requests: int
    seed: int = 0
    suffix_tokens: int = 4096

    def spec(self) -> WorkloadSpec:
        return WorkloadSpec(
            kind=self.kind,
            input_len=self.input_len,
            concurrency=self.concurrency,
            num_requests=self.num_requests,
            block_size=self.preset.block_size,
            seed=self.seed,
            suffix_tokens=self.suffix_tokens,
            token_scale=self.preset.token_scale,
        )


def default_requests(concurrency: int) -> int:
    """Requests per run: three per client (so the closed loop reaches steady state), >= 24."""
    return max(24, 3 * concurrency)


def grid(
    presets: Iterable[Preset],
    kinds: Iterable[WorkloadKind],
    input_lens: Sequence[int] | None,
    concurrencies: Iterable[int],
    *,
    requests: int | None = None,
    seed: int = 0,
    suffix_tokens: int = 4096,
) -> list[Setting]:
    """Cartesian product; ``input_lens`` None means each preset's own middle length."""
    out = []
    for preset in presets:
        lens = input_lens or (preset.input_lens[len(preset.input_lens) // 2],)
        for kind in kinds:
            for n in lens:
                for c in concurrencies:
                    num = requests or default_requests(c)
                    out.append(Setting(preset, kind, n, c, num, seed, suffix_tokens))
    return out


def paper_grid(presets: Iterable[Preset], *, seed: int = 0) -> list[Setting]:
    """40 settings per preset, the shape of the paper's PP4 evaluation: cold, 90% reuse and
    mixed at each of the preset's three lengths, plus 4K suffix at the middle length, each
    at concurrency 1, 8, 32 and 128."""
    out = []
    for preset in presets:
        kinds = (WorkloadKind.COLD, WorkloadKind.REUSE, WorkloadKind.MIXED)
        out += grid([preset], kinds, preset.input_lens, PAPER_CONCURRENCY, seed=seed)
        out += grid([preset], [WorkloadKind.SUFFIX], None, PAPER_CONCURRENCY, seed=seed)
    return out


def policies_for(num_stages: int, which: str, planner_modes: Sequence[PlannerMode]) -> list[Policy]:
    """``which``: wave, trtllm, sync-admission, both (wave and trtllm) or all; one wave policy
    per planner mode."""
    out: list[Policy] = []
    if which in ("wave", "both", "all"):
        out += [wave_policy(num_stages, mode) for mode in planner_modes]
    if which in ("trtllm", "both", "all"):
        out.append(trtllm_policy(num_stages))
    if which in ("sync-admission", "all"):
        out.append(sync_admission_policy(num_stages))
    return out


def run_setting(setting: Setting, policy: Policy, *, check_integrity: bool = False) -> SimResult:
    return Simulator(setting.preset, setting.spec(), policy, check_integrity=check_integrity).run()
