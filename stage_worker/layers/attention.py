"""Paged attention over the KV cache, for prefill chunks and decodes mixed in one step.

Legend: T = tokens in the step, h = query heads (this rank), kvh = kv heads (this rank),
G = h / kvh (grouped-query ratio), D = head_dim, B/Q/L as in `stage_worker.context`.

With the native backend the decode group runs kernels/cpu_gemm.c's decode attention, which reads
the cache's blocks in place (no gathered copy, no mask); prefill chunks use SDPA either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh_kernels import cpu_gemm
from stage_worker.context import get_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # [2, num_blocks, block_size, kvh, D], bound by the runner once the cache is allocated
        self.kv_cache: torch.Tensor | None = None
        self.backend = "torch"  # "native": decodes through kernels/cpu_gemm.c (set by the loader)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, h, D], k/v [T, kvh, D] of this step's tokens -> [T, h * D]."""
        ctx = get_context()
        h, kvh, D = self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]  # [blocks, block_size, kvh, D]
        k_cache.view(-1, kvh, D).index_copy_(0, ctx.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kvh, D).index_copy_(0, ctx.slot_mapping, v.to(v_cache.dtype))

        native = self.backend == "native" and k_cache.dtype in cpu_gemm.WEIGHT_TYPES
        if native and len(ctx.groups) == 1 and ctx.groups[0].is_decode:  # all decodes: rows are q's rows
            g = ctx.groups[0]
            o = cpu_gemm.decode_attention(q, k_cache, v_cache, g.block_table, g.kv_len, D ** -0.5, cpu_gemm.native(),
                                          checked=True)  # the runner checked the step's bounds
            return o.to(q.dtype).view(-1, h * D)
        out = torch.empty_like(q)
        for g in ctx.groups:
            B = g.block_table.shape[0]
            if g.is_decode and native:
                rows = g.token_index[:, 0]
                o = cpu_gemm.decode_attention(q[rows], k_cache, v_cache, g.block_table, g.kv_len, D ** -0.5,
                                              cpu_gemm.native(), checked=True)
                out[rows] = o.to(q.dtype)
                continue
            # whole blocks at a time (contiguous copies), then [B, L, kvh, D] -> [B, kvh, L, D]
            keys = k_cache[g.block_table].view(B, -1, kvh, D).transpose(1, 2).to(q.dtype)
            values = v_cache[g.block_table].view(B, -1, kvh, D).transpose(1, 2).to(q.dtype)
            if g.is_decode:
                # one query per sequence: its G heads sharing a kv head act as G queries of that head
                rows = g.token_index[:, 0]
                qg = q[rows].view(-1, kvh, h // kvh, D)  # [B, kvh, G, D]
                o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask)  # [B, kvh, G, D]
                out[rows] = o.reshape(-1, h, D)
            else:
                qg = q[g.token_index].transpose(1, 2)  # [B, h, Q, D]
                o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask, enable_gqa=True)
                o = o.transpose(1, 2)  # [B, Q, h, D]
                out[g.token_index[g.valid]] = o[g.valid]
        return out.view(-1, h * D)
