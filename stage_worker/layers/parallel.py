"""The tensor-parallel group a stage worker belongs to.

Layers take a `TPGroup` explicitly; with `size == 1` every collective is a no-op, so the same model
code runs unsplit in one process and split across the ranks of a stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1
    expert_parallel: bool = False  # MoE layers divide whole experts among ranks instead of slicing each
    comm_seconds: list[float] = field(default_factory=lambda: [0.0], compare=False)  # time in collectives

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            self.comm_seconds[0] += time.perf_counter() - start
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., n * size], rank-major."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.comm_seconds[0] += time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    def split(self, total: int, what: str) -> int:
        """The per-rank share of `total`; refuses a split that does not divide evenly."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor-parallel size {self.size}")
        return total // self.size

