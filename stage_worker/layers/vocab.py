"""Vocabulary-parallel embedding and lm_head: each rank holds ceil(V / tp) rows of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh_kernels import cpu_gemm
from stage_worker.layers.linear import check_shape
from stage_worker.layers.parallel import TPGroup


class VocabParallel(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        # (a vocabulary smaller than tp x (tp - 1) leaves the last ranks padding rows only)
        self.start = min(tp.rank * self.rows_per_rank, vocab_size)
        self.end = min(self.start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, tensor, shard_id=None) -> None:
        check_shape(param, tensor.shape, (self.vocab_size, param.shape[1]))
        n = self.end - self.start
        param.data[:n].copy_(tensor[self.start:self.end])
        param.data[n:].zero_()  # padding rows of the last rank


class VocabParallelEmbedding(VocabParallel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallel):
    """With the native backend the weight is also packed for kernels/cpu_gemm.c (`packed`; a tied
    embedding keeps its own copy for lookups)."""

    packed: cpu_gemm.PackedWeight | None = None
    # greedy tokens without every float32 logit (`screen_packed`)
    screen: cpu_gemm.ScreenedHead | cpu_gemm.HeadScreens | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> logits [N, V] (gathered from every rank)."""
        if self.packed is not None:
            logits = cpu_gemm.linear(hidden, self.packed)
        else:
            logits = F.linear(hidden, self.weight)
        return self.tp.all_gather_last_dim(logits)[:, :self.vocab_size]

    def screen_packed(self) -> None:
        """Builds `screen` where it pays (`cpu_gemm.screen_product`, timed here): a float32 or bfloat16
        head packed whole on this rank (one tensor rank); a float32 one through its bfloat16 copy (these
        kernels' product or torch's), a bfloat16 one through its int8 copy (for up to three rows) and
        through torch's product from 16 rows where that is faster, an int8 one (--quantization int8)
        through torch's product of its bfloat16 copy from 16 rows where that is faster."""
        self.screen = None
        if self.packed is not None and self.tp.size == 1:
            lib = cpu_gemm.native()
            self.screen = cpu_gemm.screen_head(self.packed, self.vocab_size, lib,
                                               cpu_gemm.screen_product(self.packed, self.vocab_size, lib))
