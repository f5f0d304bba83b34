"""Rotary position embedding (the rotate-half form used by Llama, Mixtral and Qwen), with the
`linear` and Llama 3.1 (`llama3`) frequency scalings. cos/sin are cached per position once."""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn

from moemesh.config import RopeConfig
from moemesh_kernels import cpu_gemm


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim / 2] float32, computed exactly as transformers computes it."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


# the cos/sin tables alive, by (head_dim, rope, positions, device): every layer of a model shares one pair
# (one per layer would be 128 MiB each at 131072 positions of 128 dims: gigabytes for a long-context model)
_TABLES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def rotary_tables(head_dim: int, rope: RopeConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim] float32 on the default device, made once while any layer
    holds them (read only)."""
    key = (head_dim, rope, max_positions, str(torch.empty(0).device))
    cos, sin = _TABLES.get((*key, "cos")), _TABLES.get((*key, "sin"))
    if cos is None or sin is None:
        inv_freq = inverse_frequencies(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        cos, sin = emb.cos(), emb.sin()
        _TABLES[(*key, "cos")], _TABLES[(*key, "sin")] = cos, sin
    return cos, sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int):
        super().__init__()
        cos, sin = rotary_tables(head_dim, rope, max_positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.backend = "torch"  # "native": float32 q/k rotated in place by kernels/cpu_gemm.c

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T]; q [T, heads, D]; k [T, kv_heads, D] -> rotated q, k (native: in place)."""
        if self.backend == "native" and q.dtype == k.dtype == torch.float32 and self.cos.dtype == torch.float32 \
                and q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == q.shape[2]:
            lib = cpu_gemm.native()
            cpu_gemm.rotary_(q, positions, self.cos, self.sin, lib)
            cpu_gemm.rotary_(k, positions, self.cos, self.sin, lib)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
