"""A slow, obviously right MoE block: one token at a time, one chosen expert at a time."""

import torch
import torch.nn.functional as F


def reference_moe(x, gate_w, w1, w3, w2, top_k, renormalize, shared=None):
    """x [T, H]; gate_w [E, H]; w1/w3 [E, I, H]; w2 [E, H, I];
    shared: None or (w_gate [Is, H], w_up [Is, H], w_down [H, Is], w_shared_gate [1, H])."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ gate_w.T, dim=-1)
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in chosen)
        for e in chosen:
            weight = probs[e] / total if renormalize else probs[e]
            h = F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            out[t] += weight * (w2[e] @ h)
        if shared is not None:
            g, u, d, sg = shared
            out[t] += torch.sigmoid(sg @ x[t]) * (d @ (F.silu(g @ x[t]) * (u @ x[t])))
    return out
