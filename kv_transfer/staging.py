"""StagingPool: registered scratch buffers for dtype-converting transfers, reused across them.

A fresh buffer per transfer costs a NIXL registration and, worse, first-touch page faults on
every byte; reusing registered buffers removes both. Contract: ``acquire`` hands out a buffer
that no other transfer uses until ``release``; a buffer whose transfer NIXL could not cancel
is never released (the owner parks it), so memory under a live transfer is never reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Staging:
    """One acquired buffer: ``tensor`` is a typed view of the registered bytes."""

    tensor: torch.Tensor
    raw: torch.Tensor
    registration: Any


class StagingPool:
    """Free registered byte buffers, best fit first; keeps at most ``max_cached_bytes`` idle."""

    def __init__(
        self,
        register: Callable[[torch.Tensor], Any],
        deregister: Callable[[Any], None],
        max_cached_bytes: int = 1 << 30,
    ) -> None:
        self._register = register
        self._deregister = deregister
        self.max_cached_bytes = max_cached_bytes
        self._free: list[tuple[torch.Tensor, Any]] = []
        self.in_use = 0

    @property
    def cached_bytes(self) -> int:
        return sum(raw.numel() for raw, _ in self._free)

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Staging:
        nbytes = max(torch.Size(shape).numel() * dtype.itemsize, 1)
        fits = [
            i
            for i, (raw, _) in enumerate(self._free)
            if raw.numel() >= nbytes and raw.device == device
        ]
        if fits:
            raw, reg = self._free.pop(min(fits, key=lambda i: self._free[i][0].numel()))
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
            reg = self._register(raw)
        self.in_use += 1
        return Staging(raw[:nbytes].view(dtype).view(shape), raw, reg)

    def release(self, staging: Staging) -> None:
        self.in_use -= 1
        self._free.append((staging.raw, staging.registration))
        self._free.sort(key=lambda entry: entry[0].numel())
        while self._free and self.cached_bytes > self.max_cached_bytes:
            _, reg = self._free.pop()  # drop the largest idle buffer
            self._deregister(reg)

    def close(self) -> None:
        for _, reg in self._free:
            self._deregister(reg)
        self._free.clear()
