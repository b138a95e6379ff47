"""EngineConfig: what a pipeline runs, one frozen value validated once, for either transport.

Every way of starting an engine reads this one value: ``wavepp serve`` and ``wavepp
prefill`` build it from their shared flags (cli/options.py, one set of defaults, these),
``build_engine(config, transport)`` (factory.py) starts it as a pipeline of processes or
in one process, and tests and benchmarks build it directly. From it the engine derives the
``PipelineSpec`` every stage reads (``pipeline_spec``: the resolved layer split, the model
source, b_min); nothing else carries engine settings. Error messages name the CLI flag.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from prefill_node.core.planner import check_min_wave_tokens, default_min_wave_tokens, wave_budget
from prefill_node.core.policy import POLICY_NAMES
from prefill_node.errors import InvalidRequestError
from prefill_node.model.partition import LayerRange, split_layers
from prefill_node.runtime.spec import DEVICES, DTYPES, ModelSource, PipelineSpec

if TYPE_CHECKING:
    from prefill_node.kv_handoff.config import KVHandoffConfig

TRANSPORTS = ("pipeline", "local")  # one process per stage / every stage in this process


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """``model_dir``: a Hugging Face checkpoint directory (config.json + safetensors; None
    for an engine built from weights in memory). ``num_blocks``: KV blocks per stage, one
    value for every stage or one per stage (an int is one value). ``max_wave_tokens``: the
    wave budget M (the fixed chunk budget under ``trtllm`` and ``sync-admission``), rounded
    up here to whole blocks; ``min_wave_tokens``: the planner's b_min, whole blocks up to M
    (None: M/2); ``wave_overhead_tokens``: a wave's fixed cost in tokens, from which the
    planner sizes the waves of a shallow queue so that fill and drain stay short
    (core/planner.py's drain bound; 0: off). ``max_model_len`` None: the model's
    ``max_position_embeddings``. ``layer_ranges``: (start, end) per stage (None: an even
    split). ``kv_handoff``: every stage gets a NIXL agent and hands the KV of requests with a
    ``kv_destination`` to decode (None: such requests are refused). ``core_share``: locally
    launched CPU stages lend their cores to the stages computing while they idle
    (runtime/core_share.py); ``core_board``: the host board file every pipeline on this host
    started with the same path joins, so their stages lend cores across pipelines (None:
    within this one). ``stage_wait_s``: how long the leader waits for every stage to join.
    ``debug_wave_delay_s`` (tests only): every stage sleeps this long per wave."""

    model_dir: Path | None = None
    stages: int = 2
    policy: str = "wave"
    num_blocks: tuple[int, ...] = (1024,)
    block_size: int = 16
    max_wave_tokens: int = 512
    min_wave_tokens: int | None = None
    wave_overhead_tokens: int = 0
    max_model_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    layer_ranges: tuple[tuple[int, int], ...] | None = None
    kv_handoff: KVHandoffConfig | None = None
    core_share: bool = True
    core_board: Path | None = None
    stage_wait_s: float = 600.0
    debug_wave_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise InvalidRequestError(f"--stages must be >= 1, got {self.stages}")
        if self.policy not in POLICY_NAMES:
            raise InvalidRequestError(
                f"--policy must be one of {POLICY_NAMES}, got {self.policy!r}"
            )
        blocks = (self.num_blocks,) if isinstance(self.num_blocks, int) else self.num_blocks
        if len(blocks) not in (1, self.stages) or min(blocks) < 2:
            raise InvalidRequestError(
                f"--num-blocks: give one value or one per stage ({self.stages}), each >= 2; "
                f"got {self.num_blocks}"
            )
        object.__setattr__(self, "num_blocks", tuple(blocks))
        budget = wave_budget(self.max_wave_tokens, self.block_size)
        object.__setattr__(self, "max_wave_tokens", budget)
        check_min_wave_tokens(self.min_wave_tokens, budget, self.block_size)
        if self.wave_overhead_tokens < 0:
            raise InvalidRequestError(
                f"--wave-overhead-tokens must be >= 0 (0: no drain bound), got "
                f"{self.wave_overhead_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.core_board is not None and not self.core_share:
            raise InvalidRequestError(
                "--core-board shares cores with the host's other pipelines: it needs core "
                "sharing on (drop --no-core-share)"
            )
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise InvalidRequestError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if self.layer_ranges is not None:
            ranges = tuple((int(a), int(b)) for a, b in self.layer_ranges)
            if len(ranges) != self.stages:
                raise InvalidRequestError(
                    f"layer ranges {list(ranges)} must give {self.stages} stages"
                )
            object.__setattr__(self, "layer_ranges", ranges)
        if self.stage_wait_s <= 0:
            raise InvalidRequestError(f"--stage-wait must be > 0, got {self.stage_wait_s}")
        if not 0.0 <= self.debug_wave_delay_s <= 10.0:
            raise InvalidRequestError(
                f"--debug-wave-delay must be in [0, 10] s, got {self.debug_wave_delay_s}"
            )

    @property
    def stage_num_blocks(self) -> tuple[int, ...]:
        """KV blocks of each stage."""
        if len(self.num_blocks) == 1:
            return self.num_blocks * self.stages
        return self.num_blocks

    def stage_layers(self, num_layers: int) -> tuple[LayerRange, ...]:
        """Each stage's layers of a ``num_layers``-layer model: ``layer_ranges``, or an even
        split (``split_layers``)."""
        if self.layer_ranges is None:
            return tuple(split_layers(num_layers, self.stages))
        ranges = self.layer_ranges
        starts = [0] + [b for _, b in ranges[:-1]]
        if [a for a, _ in ranges] != starts or ranges[-1][1] != num_layers:
            raise InvalidRequestError(
                f"layer ranges {list(ranges)} must be contiguous and cover all {num_layers} layers"
            )
        return tuple(LayerRange(a, b) for a, b in ranges)

    def pipeline_spec(
        self,
        layers: tuple[LayerRange, ...],
        model: ModelSource | None = None,
        *,
        kv_events: bool = False,
    ) -> PipelineSpec:
        """The spec every stage and the leader read: this config with the model's layer
        split resolved (``layers``, e.g. ``stage_layers``) and where the stages get their
        weights (``model``: None when the engine builds them in this process)."""
        m, bs = self.max_wave_tokens, self.block_size
        return PipelineSpec(
            model=model,
            layer_ranges=tuple((r.start, r.end) for r in layers),
            stage_blocks=self.stage_num_blocks,
            block_size=bs,
            policy=self.policy,
            max_wave_tokens=m,
            min_wave_tokens=self.min_wave_tokens or default_min_wave_tokens(m, bs),
            wave_overhead_tokens=self.wave_overhead_tokens,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
            kv_events=kv_events,
            debug_wave_delay_s=self.debug_wave_delay_s,
        )


def config_defaults() -> dict[str, object]:
    """``EngineConfig``'s field defaults by name: the one source of the defaults the CLI
    shows."""
    return {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}
