"""Hardware and model descriptions the simulator's roofline reads: model shape, GPU, link, rounds.

Plain frozen dataclasses, validated once; every derived quantity (parameters per layer,
attention FLOPs per query-key pair, KV bytes per token) is a property so a preset only
states what a model card or a spec sheet states. A model the backend can run is described
once, as the backend's ``ModelConfig`` (parsed from its ``config.json``), and its
``ModelSpec`` is derived from it (``ModelSpec.from_config``) with the serving precisions
added; ``tests/test_sim_specs.py`` pins the two cost shapes to the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from prefill_node.errors import InvalidRequestError
from prefill_node.model.config import ModelConfig  # torch-free


class InvalidSpecError(InvalidRequestError):
    """A model / hardware spec field is out of range; the message names it."""


def _require_positive(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise InvalidSpecError(f"{type(obj).__name__}.{name} must be > 0, got {value}")


def _require_non_negative(obj: object) -> None:
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, int | float) and value < 0:
            raise InvalidSpecError(f"{type(obj).__name__}.{f.name} must be >= 0, got {value}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder LLM's shape. MLA when ``kv_lora_rank > 0``; sparse attention when ``index_topk``.

    Dense layers are the first ``num_dense_layers``; the rest are MoE layers with
    ``num_experts`` routed experts (``active_experts`` per token) plus ``shared_experts``.
    A dense model has ``num_experts = 0``.
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_intermediate: int
    vocab: int
    num_dense_layers: int = 0
    num_experts: int = 0
    active_experts: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    kv_lora_rank: int = 0  # MLA latent width; 0 = GQA
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0  # MLA only; GQA uses head_dim
    index_topk: int = 0  # DeepSeek-style sparse attention: keys attended per query; 0 = dense
    index_heads: int = 0
    index_head_dim: int = 0
    weight_bytes: float = 2.0  # per parameter, scales included (NVFP4 ~ 0.5625)
    kv_bytes: float = 2.0  # per cached element (FP8 = 1)
    act_bytes: float = 2.0  # per activation element sent between stages (BF16 = 2)

    def __post_init__(self) -> None:
        _require_positive(self, ("num_layers", "hidden", "num_heads", "head_dim", "vocab"))
        _require_non_negative(self)
        if self.kv_lora_rank == 0:
            _require_positive(self, ("num_kv_heads",))
        if self.num_experts and not 0 < self.active_experts <= self.num_experts:
            raise InvalidSpecError(f"{self.name}: need 0 < active_experts <= num_experts")
        if self.num_dense_layers > self.num_layers:
            raise InvalidSpecError(f"{self.name}: num_dense_layers > num_layers")

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        *,
        weight_bytes: float,
        kv_bytes: float,
        act_bytes: float = 2.0,
    ) -> ModelSpec:
        """The simulator's view of a model the backend describes: ``config``'s shapes (its
        ``name`` becomes the spec's) at the given serving precisions. Raises InvalidSpecError
        for recurrent (linear-attention) layers, which the roofline has no cost for."""
        if config.recurrent is not None:
            raise InvalidSpecError(
                f"{config.name}: the simulator's roofline has no cost for recurrent "
                "(linear-attention) layers"
            )
        moe, mla = config.moe, config.mla
        if moe is not None and moe.shared_width != moe.num_shared_experts * (
            moe.expert_intermediate_size
        ):
            raise InvalidSpecError(
                f"{config.name}: shared experts of another width than the routed ones"
            )
        shape: dict = dict(
            name=config.name,
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dense_intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            weight_bytes=weight_bytes,
            kv_bytes=kv_bytes,
            act_bytes=act_bytes,
        )
        if moe is not None:
            shape.update(
                num_dense_layers=moe.first_dense_layers,
                num_experts=moe.num_experts,
                active_experts=moe.top_k,
                shared_experts=moe.num_shared_experts,
                moe_intermediate=moe.expert_intermediate_size,
            )
        if mla is not None:
            shape.update(
                num_kv_heads=1,
                head_dim=mla.qk_nope_head_dim,
                kv_lora_rank=mla.kv_lora_rank,
                q_lora_rank=mla.q_lora_rank or 0,
                qk_rope_dim=mla.qk_rope_head_dim,
                v_head_dim=mla.v_head_dim,
                index_topk=mla.index_topk,
                index_heads=mla.index_n_heads,
                index_head_dim=mla.index_head_dim,
            )
        return cls(**shape)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> int:
        """Projection parameters of one attention layer (indexer included)."""
        h, n = self.hidden, self.num_heads
        if self.is_mla:
            qk = self.head_dim + self.qk_rope_dim
            q = h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank else h * n * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_dim)
            kv += self.kv_lora_rank * n * (self.head_dim + self.v_head_dim)
            out = n * self.v_head_dim * h
        else:
            q = h * n * self.head_dim
            kv = 2 * h * self.num_kv_heads * self.head_dim
            out = n * self.head_dim * h
        # the indexer: its queries from the q LoRA (the hidden state without one), its key
        # and its per-head weights from the hidden state
        index_q = (self.q_lora_rank or h) * self.index_heads * self.index_head_dim
        index = index_q + h * (self.index_head_dim + self.index_heads)
        return q + kv + out + (index if self.index_topk else 0)

    def mlp_params(self, layer: int) -> tuple[int, int]:
        """(total, active per token) MLP parameters of ``layer`` (router included)."""
        h = self.hidden
        if layer < self.num_dense_layers or self.num_experts == 0:
            p = 3 * h * self.dense_intermediate
            return p, p
        expert = 3 * h * self.moe_intermediate
        router = h * self.num_experts
        total = expert * (self.num_experts + self.shared_experts) + router
        active = expert * (self.active_experts + self.shared_experts) + router
        return total, active

    def pair_flops(self) -> float:
        """FLOPs of one query attending one key in one layer (QK^T plus PV, all heads)."""
        qk = self.head_dim + self.qk_rope_dim if self.is_mla else self.head_dim
        v = self.v_head_dim if self.is_mla else self.head_dim
        return 2.0 * self.num_heads * (qk + v)

    def index_pair_flops(self) -> float:
        """FLOPs of the sparse-attention indexer scoring one key for one query (0 if dense)."""
        return 2.0 * self.index_heads * self.index_head_dim if self.index_topk else 0.0

    def kv_bytes_per_token_layer(self) -> float:
        """Cached bytes per token per layer: MLA latent + rope or GQA K and V, + index keys."""
        if self.is_mla:
            elems = self.kv_lora_rank + self.qk_rope_dim
        else:
            elems = 2 * self.num_kv_heads * self.head_dim
        return (elems + (self.index_head_dim if self.index_topk else 0)) * self.kv_bytes

    def total_params(self) -> int:
        """All parameters (embedding and untied LM head included), for sanity checks."""
        layers = sum(
            self.attention_params() + self.mlp_params(i)[0] for i in range(self.num_layers)
        )
        return layers + 2 * self.vocab * self.hidden


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator (or one CPU socket share) as the roofline sees it."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    linear_flops_per_s: float  # dense peak at the weights' precision (NVFP4 on Blackwell)
    attention_flops_per_s: float  # dense peak at the attention kernels' precision (FP8)
    flops_efficiency: float = 0.5  # achievable fraction of peak for large prefill GEMMs
    bandwidth_efficiency: float = 0.8
    usable_memory_fraction: float = 0.9  # what the runtime may claim (allocator slack)
    workspace_bytes: float = 0.0  # activations / kernels workspace at the max wave size
    layer_overhead_s: float = 0.0  # launch + host overhead per layer per wave
    chunk_overhead_s: float = 0.0  # per layer per chunk of a wave (per-chunk attention calls)

    def __post_init__(self) -> None:
        _require_positive(
            self,
            ("memory_bytes", "hbm_bytes_per_s", "linear_flops_per_s", "attention_flops_per_s"),
        )
        _require_non_negative(self)
        if not 0 < self.flops_efficiency <= 1 or not 0 < self.bandwidth_efficiency <= 1:
            raise InvalidSpecError(f"{self.name}: efficiencies must be in (0, 1]")


@dataclass(frozen=True)
class LinkSpec:
    """Stage-to-stage activation link: ``latency_s + bytes / bytes_per_s``."""

    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        _require_positive(self, ("bytes_per_s",))
        _require_non_negative(self)

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class RoundCostSpec:
    """Latency of one admission round over the rounds plane.

    ``phases`` message phases (hint all-gather, lease confirmation, escrow commit), each
    costing ``phase_latency_s`` (leader broadcast + all-gather across the P stages), plus
    the host work of the requests the round sees for the first time: ``host_s_per_token``
    per prompt token (transport, hashing, hint probe, pinning and escrowing blocks), done
    on every stage in parallel; ``host_s_per_cached_token``, when set, replaces it for the
    tokens of a request's seeded (expected cached) prefix, which are leased rather than
    escrowed. Retrying a waiting request costs only the phases (its spec
    is registered and hashed already; an FCFS-blocked reserve answers at once).

    ``walk_s_per_token``: host seconds per matched-prefix token of one radix-tree prefix
    walk, which the trtllm baseline's scheduler repeats on every loop iteration
    (``executor_loops.py``). Default 27 ns (measured): ``bench/trtllm_walk.cpp`` times the
    operations of TensorRT-LLM's C++ ``findNewContextBlock`` (copy the prompt's tokens, cut
    them into per-block keys, walk a tree of hash maps hashing each key) at 3.8-3.9 ms for
    a 131,072-token prompt with 126,976 cached and 0.44 ms with nothing cached, on the
    development VM: 27 ns per cached token plus 3.4 ns per prompt token (the latter is
    ``TrtllmLoopCosts.walk_base_s_per_token``). That is C++ speed against our Python
    core's 250 ns per admitted token, which favours the baseline; at equal per-token
    efficiency (our core's prefix hashing is 0.61-0.92 of its whole per-token admission
    cost) it would be ~150 ns (``wavepp sim --walk-ns-per-token 150``).
    """

    phase_latency_s: float
    host_s_per_token: float
    phases: int = 3
    walk_s_per_token: float = 27e-9
    host_s_per_cached_token: float | None = None  # None: host_s_per_token for every token

    def __post_init__(self) -> None:
        _require_non_negative(self)
        if self.phases < 1:
            raise InvalidSpecError("RoundCostSpec.phases must be >= 1")

    def host_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Host seconds for first-seen requests of ``prompt_tokens`` tokens, ``cached_tokens``
        of them expected cached (``host_s_per_cached_token`` each, when set)."""
        cached = min(cached_tokens, prompt_tokens)
        per_cached = self.host_s_per_token
        if self.host_s_per_cached_token is not None:
            per_cached = self.host_s_per_cached_token
        return self.host_s_per_token * (prompt_tokens - cached) + per_cached * cached

    def scaled_host(self, factor: float) -> RoundCostSpec:
        """These costs with every host term (admission per token, walks) times ``factor``;
        the phases' latency (messages between hosts) stays."""
        cached = self.host_s_per_cached_token
        return replace(
            self,
            host_s_per_token=self.host_s_per_token * factor,
            walk_s_per_token=self.walk_s_per_token * factor,
            host_s_per_cached_token=None if cached is None else cached * factor,
        )

    def round_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds of one round whose first-seen requests total ``prompt_tokens`` tokens."""
        return self.phases * self.phase_latency_s + self.host_s(prompt_tokens, cached_tokens)
