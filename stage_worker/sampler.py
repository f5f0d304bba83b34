"""Turning the last stage's logits into tokens.

Greedy rows take the argmax. Other rows: temperature, top-k, top-p and min-p filters, then one draw
by the exponential race (argmax of p / Exp(1) noise), which equals sampling from p. A seeded
request draws its noise from a generator seeded by (seed, index of the token being sampled), so its
tokens do not depend on what else is in the batch, on the pipeline layout, or on a recomputation
after preemption.
"""

from __future__ import annotations

import torch

from moemesh.sampling import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def sample(logits: torch.Tensor, params: list[SamplingParams], output_lens: list[int],
           eos_token_ids: tuple[int, ...] = (), generator: torch.Generator | None = None) -> list[int]:
    """logits [N, V] float32; params and output_lens (tokens generated so far) per row -> N tokens."""
    if any(n < p.min_tokens for n, p in zip(output_lens, params)):
        logits = logits.clone()
    for i, p in enumerate(params):
        if output_lens[i] < p.min_tokens:  # too early to stop: EOS and stop tokens are off the table
            banned = [t for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids) if t < logits.shape[1]]
            logits[i, banned] = float("-inf")
    tokens = logits.max(dim=-1).indices  # first maximum, like argmax, and faster on CPU
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows)
        probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            p = params[i]
            if p.seed is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed((p.seed * _MIX + output_lens[i] + 1) % (1 << 63))
                noise[j].exponential_(generator=g)
            else:
                noise[j].exponential_(generator=generator)
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, V] logits -> probabilities after temperature, top-k, top-p and min-p."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        rank = torch.arange(V).unsqueeze(0)
        k = torch.tensor([k if k > 0 else V for k in top_k]).unsqueeze(1)
        drop = rank >= k
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # top-p: keep the smallest prefix whose mass reaches p (always the top token); rows with
        # top_p == 1 are left alone (a float32 cumsum can round up to 1 before the tail ends)
        before = probs.cumsum(-1) - probs
        p = torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
        drop |= (before >= p) & (p < 1)
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
