"""RMSNorm with an optional fused residual add (the residual stream rides beside the hidden state).
With the native backend, float32 [T, H] inputs take one call of kernels/cpu_gemm.c instead of six
torch ops."""

from __future__ import annotations

import torch
from torch import nn

from moemesh_kernels import cpu_gemm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.backend = "torch"  # set by the loader (moemesh_kernels.backend)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # as Hugging Face does: statistics in float32, scale applied in the input dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.backend == "native" and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 \
                and (residual is None or (residual.dtype == torch.float32 and residual.stride(1) == 1)):
            out, res = cpu_gemm.rms_norm(x, self.weight, self.eps, residual, cpu_gemm.native())
            return out if residual is None else (out, res)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
