"""A slow, obviously right MoE block: one token at a time, one chosen expert at a time."""

import torch
import torch.nn.functional as F


def reference_moe(x, gate_w, w1, w3, w2, top_k, renormalize, shared=None, expert_input=None):
    """x [T, H]; gate_w [E, H]; w1/w3 [E, I, H]; w2 [E, H, I];
    shared: None or (w_gate [Is, H], w_up [Is, H], w_down [H, Is], w_shared_gate [1, H]);
    expert_input(v, e): what expert e's products see of their inputs (x and the activation before
    w2), e.g. a rounding to bfloat16; default: the values themselves."""
    r = expert_input or (lambda v, e: v)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ gate_w.T, dim=-1)
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in chosen)
        for e in chosen:
            weight = probs[e] / total if renormalize else probs[e]
            h = F.silu(w1[e] @ r(x[t], e)) * (w3[e] @ r(x[t], e))
            out[t] += weight * (w2[e] @ r(h, e))
        if shared is not None:
            g, u, d, sg = shared
            out[t] += torch.sigmoid(sg @ x[t]) * (d @ (F.silu(g @ x[t]) * (u @ x[t])))
    return out
