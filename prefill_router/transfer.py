"""How long fetching a prefix's blocks from another pipeline takes: the router's transfer model.

A fetch copies ``n`` blocks of a prefix from a source pipeline that holds them to the pipeline
that will run the request, every stage reading its own layers' blocks from the source's stage
holding the same layers (each stage moves 1/P of the bytes over its own link, all at once).
Its time is modelled as ``fixed_s + n * per_block_s``: a fixed cost per fetch (the lease on
the source, the transfer's setup) and the bytes of one block on the busiest stage over that
stage's link. ``TransferFit`` starts from a prior (the link's nominal numbers) and refits
both terms by least squares over the fetches it has seen, so queueing on shared links and the
real setup cost enter the router's predictions as they happen.

Sans-IO and torch-free: the router core and the cluster simulator (``wavepp sim --cluster``)
use it alike.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prefill_node.errors import InvalidRequestError


class InvalidTransferInputError(InvalidRequestError):
    """A transfer model term or a fetch sample is negative, not finite, or empty."""


@dataclass(frozen=True, slots=True)
class TransferModel:
    """Seconds to fetch ``blocks`` blocks: ``fixed_s + blocks * per_block_s``."""

    fixed_s: float
    per_block_s: float

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_block_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidTransferInputError(f"{name} must be finite and >= 0, got {value}")

    def fetch_s(self, blocks: int) -> float:
        return self.fixed_s + blocks * self.per_block_s if blocks > 0 else 0.0

    @classmethod
    def for_link(
        cls, stage_block_bytes: float, link_bytes_per_s: float, fixed_s: float
    ) -> TransferModel:
        """The nominal model: ``stage_block_bytes`` (one block's KV on the stage that holds the
        most layers) over one stage's link of ``link_bytes_per_s``."""
        if not (link_bytes_per_s > 0 and math.isfinite(link_bytes_per_s)):
            raise InvalidTransferInputError(f"link bandwidth must be > 0: {link_bytes_per_s}")
        return cls(fixed_s, stage_block_bytes / link_bytes_per_s)


class TransferFit:
    """The transfer model the router predicts with: ``prior`` until ``min_samples`` fetches
    were observed, then the least-squares line through the last ``window`` samples of
    (blocks, seconds). A fit that comes out negative in either term falls back to the
    through-origin line (per-block cost only) or, failing that, keeps the prior."""

    def __init__(self, prior: TransferModel, window: int = 256, min_samples: int = 8) -> None:
        if window < 2 or not 2 <= min_samples <= window:
            raise InvalidTransferInputError("need window >= 2 and 2 <= min_samples <= window")
        self.prior = prior
        self.model = prior
        self.min_samples = min_samples
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def observe(self, blocks: int, seconds: float) -> TransferModel:
        """One finished fetch of ``blocks`` blocks that took ``seconds``; returns the model."""
        if blocks < 1 or not (math.isfinite(seconds) and seconds >= 0):
            raise InvalidTransferInputError(f"bad fetch sample: {blocks} blocks in {seconds} s")
        self._samples.append((blocks, seconds))
        if len(self._samples) >= self.min_samples:
            self.model = self._fit()
        return self.model

    def _fit(self) -> TransferModel:
        n = len(self._samples)
        sx = sum(b for b, _ in self._samples)
        sy = sum(s for _, s in self._samples)
        sxx = sum(b * b for b, _ in self._samples)
        sxy = sum(b * s for b, s in self._samples)
        var = n * sxx - sx * sx
        if var > 0:
            slope = (n * sxy - sx * sy) / var
            intercept = (sy - slope * sx) / n
            if slope >= 0 and intercept >= 0:
                return TransferModel(intercept, slope)
        if sxx > 0 and sxy >= 0:  # one size seen, or a negative intercept: per block only
            return TransferModel(0.0, sxy / sxx)
        return self.model
