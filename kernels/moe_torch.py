"""Fused-MoE routing and expert computation in plain torch: the CPU backend.

Legend: T = tokens, E = experts (held by this rank), K = experts per token (top-k),
H = hidden size, I = intermediate size (this rank's share), N = T * K routed rows.

Rows are sorted by expert so that each non-empty expert runs as one dense matmul over all of its
tokens (not a loop over tokens); results are weighted and scatter-added back per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """router_logits [T, E] -> (weights [T, K] float32, ids [T, K] long): softmax in float32, top-k,
    optionally renormalised so a token's weights sum to 1."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_* [T, K] -> [T, H].

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])), e = topk_ids[t, k].
    Experts are numbered globally; this rank holds experts expert_offset .. expert_offset + E - 1 and
    ignores the rest (expert parallelism: other ranks add theirs in the all-reduce).
    """
    T, K = topk_ids.shape
    E = w13.shape[0]
    flat_ids = topk_ids.reshape(-1) - expert_offset  # [N]
    order = torch.argsort(flat_ids, stable=True)  # [N] routed rows sorted by expert
    counts = torch.bincount(flat_ids.clamp(-1, E).add(1), minlength=E + 2).tolist()  # [-1 | 0..E-1 | E]
    token_of = order // K  # [N] token of each sorted row
    weight_of = topk_weights.reshape(-1)[order].unsqueeze(1)  # [N, 1]

    out = x.new_zeros(T, x.shape[1])
    start = counts[0]  # rows routed to lower experts (held by other ranks) sort first
    for e in range(E):
        n = counts[e + 1]
        if n == 0:
            continue
        rows = token_of[start:start + n]
        h = F.linear(x[rows], w13[e])  # [n, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])  # [n, H]
        out.index_add_(0, rows, (y * weight_of[start:start + n]).to(out.dtype))
        start += n
    return out
