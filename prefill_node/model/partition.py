"""Stage slicing: which contiguous range of decoder layers each pipeline stage holds.

Torch-free. A stage holding ``LayerRange(a, b)`` owns layers a..b-1, their weights and their
KV; the first stage also owns the embedding, the last the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prefill_node.errors import InvalidPartitionError


@dataclass(frozen=True)
class LayerRange:
    """Global layer indices [start, end) of one stage; never empty."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise InvalidPartitionError(
                f"a layer range needs 0 <= start < end, got [{self.start}, {self.end})"
            )

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def local(self, global_layer: int) -> int:
        """Index of ``global_layer`` within this range (0 for ``start``)."""
        if global_layer not in self:
            raise InvalidPartitionError(f"layer {global_layer} is not in stage layers {self}")
        return global_layer - self.start

    def is_first(self) -> bool:
        return self.start == 0

    def is_last(self, num_layers: int) -> bool:
        return self.end == num_layers

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def split_layers(
    num_layers: int, num_stages: int, weights: Sequence[float] | None = None
) -> list[LayerRange]:
    """Split ``num_layers`` into ``num_stages`` contiguous ranges, each with >= 1 layer.

    Without ``weights`` the split is as even as possible, earlier stages taking the extra
    layers (first and last stages also carry the embedding / LM head, but those are cheap
    next to a layer for prefill). With ``weights`` (one positive number per stage) stage s
    gets about ``num_layers * weights[s] / sum(weights)`` layers: boundaries are the rounded
    cumulative shares, then nudged so every stage keeps at least one layer.
    """
    if num_stages < 1 or num_layers < 1:
        raise InvalidPartitionError(
            f"need >= 1 layer and >= 1 stage, got {num_layers} layers, {num_stages} stages"
        )
    if num_stages > num_layers:
        raise InvalidPartitionError(
            f"cannot split {num_layers} layers into {num_stages} stages (each needs >= 1 layer)"
        )
    if weights is None:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        bounds = [sum(sizes[:s]) for s in range(num_stages + 1)]
    else:
        bounds = _weighted_bounds(num_layers, num_stages, weights)
    return [LayerRange(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def _weighted_bounds(num_layers: int, num_stages: int, weights: Sequence[float]) -> list[int]:
    if len(weights) != num_stages:
        raise InvalidPartitionError(
            f"got {len(weights)} stage weights for {num_stages} stages; give one per stage"
        )
    if any(not w > 0 for w in weights):
        raise InvalidPartitionError(f"stage weights must all be > 0, got {list(weights)}")
    total = float(sum(weights))
    bounds = [0]
    acc = 0.0
    for s in range(1, num_stages):
        acc += weights[s - 1]
        ideal = round(num_layers * acc / total)
        # leave >= 1 layer for this stage and for each stage after it
        lo, hi = bounds[-1] + 1, num_layers - (num_stages - s)
        bounds.append(min(max(ideal, lo), hi))
    bounds.append(num_layers)
    return bounds
