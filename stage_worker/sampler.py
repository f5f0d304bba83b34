"""Turning the last stage's logits into tokens.

Per row, in order: a structured output's mask (tokens its grammar does not allow next are off the
table) and allowed_token_ids (only those are), bad_words (a word's last token, where the output ends
with the rest of it), logit_bias (added to the logits, as OpenAI's and vLLM's), min_tokens (EOS and
stop tokens banned until enough tokens exist), repetition penalty (prompt and output tokens),
presence and frequency penalties (output tokens), then greedy rows take the argmax; the others
apply temperature, min-p, top-k and top-p and draw once by the exponential race (argmax of
p / Exp(1) noise, which samples from p). A seeded request draws its noise from a generator seeded
by (seed, index of the token being sampled), so its tokens do not depend on what else is in the
batch, on the pipeline layout, or on a recomputation after preemption.

Logprobs are of the model's own distribution (log-softmax of the raw logits, before penalties and
temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.protocol import TokenLogprobs
from moemesh.sampling import SamplingParams

_MIX = 0x9E3779B97F4A7C15


@dataclass
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # generated so far
    allowed: torch.Tensor | None = None  # [V] bool: the tokens a structured output's grammar allows next
    edits: "TokenEdits | None" = None  # params' allowed_token_ids, logit_bias and bad_words (made if not given)


@dataclass(frozen=True)
class TokenEdits:
    """A sequence's allowed_token_ids, logit_bias and bad_words as a vocabulary of V tokens takes them (ids
    beyond it dropped), made once per sequence (StageExecutor keeps them), not at every step: a set may
    hold every id of the vocabulary, and a request hundreds of bad words."""
    only: torch.Tensor | None  # [V] bool; None where no id of the set is in the vocabulary (nothing to keep to)
    bias_ids: torch.Tensor | None  # [n] long
    bias: torch.Tensor | None  # [n] float32
    ban_always: tuple[int, ...] = ()  # one-token bad words
    ban_after: dict[int, tuple[tuple[int, ...], ...]] | None = None  # longer ones, by their next-to-last token

    @classmethod
    def of(cls, params: SamplingParams, V: int) -> "TokenEdits":
        only = None
        if params.allowed_token_ids is not None:
            ids = torch.tensor(params.allowed_token_ids, dtype=torch.long)
            ids = ids[ids < V]
            if len(ids):
                only = torch.zeros(V, dtype=torch.bool)
                only[ids] = True
        biased = [(t, b) for t, b in params.logit_bias if t < V]
        bias_ids = torch.tensor([t for t, _ in biased], dtype=torch.long) if biased else None
        bias = torch.tensor([b for _, b in biased], dtype=torch.float32) if biased else None
        words = [w for w in params.bad_words if w[-1] < V]
        after: dict[int, list[tuple[int, ...]]] = {}
        for w in words:
            if len(w) > 1:
                after.setdefault(w[-2], []).append(w)
        return cls(only, bias_ids, bias, tuple(sorted({w[0] for w in words if len(w) == 1})),
                   {k: tuple(v) for k, v in after.items()} or None)

    def banned_next(self, output_ids: list[int]) -> list[int]:
        """The tokens that would complete a bad word now: each word's last token where the generated
        tokens end with the rest of it (a one-token word's, always), as vLLM bans them."""
        banned = set(self.ban_always)
        if self.ban_after and output_ids:
            for w in self.ban_after.get(output_ids[-1], ()):
                n = len(w) - 1
                if n <= len(output_ids) and tuple(output_ids[-n:]) == w[:-1]:
                    banned.add(w[-1])
        return sorted(banned)


def sample(logits: torch.Tensor, rows: list[SampleRow], eos_token_ids: tuple[int, ...] = (),
           generator: torch.Generator | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [N, V] float32, one row per SampleRow -> (N tokens, N logprobs or None)."""
    raw = logits
    if any(_needs_edit(r) for r in rows):
        logits = logits.clone()
    V = logits.shape[1]
    edits = [(r.edits or TokenEdits.of(r.params, V)) if r.params.edits_logits else None for r in rows]
    masks = [_allowed(r, e, V) for r, e in zip(rows, edits)]
    masked = [i for i, m in enumerate(masks) if m is not None]
    if masked:  # the masks, in one pass (host masks: to the logits' device)
        idx = torch.tensor(masked, device=logits.device)
        allowed = torch.stack([masks[i] for i in masked]).to(logits.device)
        logits[idx] = torch.where(allowed, logits[idx], float("-inf"))
    for i, r in enumerate(rows):
        p = r.params
        # bans: where one would leave nothing to sample (a grammar's end, a ban of every token), it is not
        # made; `left` follows what the row may still sample, on the host (None: every token)
        left = masks[i]
        if p.bad_words:
            left = _ban(logits, i, edits[i].banned_next(r.output_ids), left, V)
        if edits[i] is not None and edits[i].bias is not None:
            logits[i].index_add_(0, edits[i].bias_ids.to(logits.device),
                                 edits[i].bias.to(device=logits.device, dtype=logits.dtype))
        if len(r.output_ids) < p.min_tokens:  # too early to stop: EOS and stop tokens are off the table
            banned = sorted({t for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids) if 0 <= t < V})
            left = _ban(logits, i, banned, left, V)
        if p.has_penalties:
            _apply_penalties(logits[i], r, V)
    tokens = greedy_tokens(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[idx], [rows[i].params for i in random_rows])
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            p = rows[i].params
            if p.seed is not None:
                g = torch.Generator(device=probs.device)
                g.manual_seed((p.seed * _MIX + len(rows[i].output_ids) + 1) % (1 << 63))
                noise[j].exponential_(generator=g)
            else:
                noise[j].exponential_(generator=generator)
        tokens[idx] = (probs / noise).argmax(dim=-1)
    token_list = tokens.tolist()
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if want:
        lp = torch.log_softmax(raw[torch.tensor(want, device=raw.device)], dim=-1)
        for j, i in enumerate(want):
            logprobs[i] = token_logprobs(lp[j], token_list[i], rows[i].params.logprobs)
    return token_list, logprobs


def verify_sampled(logits: torch.Tensor, params: SamplingParams, draft: list[int],
                   generator: torch.Generator | None) -> list[int]:
    """Speculative sampling's check of draft tokens proposed with certainty (prompt lookup): logits
    [k + 1, V], row i's distribution p_i (temperature, min-p, top-k, top-p as `sample` applies them)
    after the sequence's tokens and draft[:i]. Draft token i is kept with probability p_i(draft[i]);
    the first refused is replaced by a draw from p_i without it (renormalized), and after k kept a
    token is drawn from p_k. Each token so made is distributed as sampling it from p_i would be (the
    standard rejection scheme with a draft distribution that puts all its mass on the draft token).
    -> the tokens kept: 1 to k + 1."""
    probs = _filtered_probs(logits, [params] * logits.shape[0])
    kept = []
    for i, d in enumerate(draft):
        if torch.rand((), generator=generator, device=probs.device) < probs[i, d]:
            kept.append(d)
            continue
        rest = probs[i].clone()
        rest[d] = 0
        kept.append(_draw(rest, generator))
        return kept
    kept.append(_draw(probs[len(draft)], generator))
    return kept


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the weights p [V] (not normalized): the exponential race, as `sample` draws."""
    return int((p / torch.empty_like(p).exponential_(generator=generator)).argmax())


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] long: the first maximum of each row (torch's max, faster than argmax on CPU;
    the native kernels' one pass over the rows where they are built)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[1] > 0:
        from moemesh_kernels.cpu_gemm import argmax_rows, native

        lib = native()
        if lib is not None:
            return argmax_rows(logits, lib)
    return logits.max(dim=-1).indices


def token_logprobs(logprobs_row: torch.Tensor, token: int, top_n: int, rank: int = 0) -> TokenLogprobs:
    """One position's logprob of `token` and its top-N alternatives, from a [V] log-softmax row (and
    the token's rank, where the caller computed it: `token_ranks`)."""
    top = []
    if top_n:
        values, ids = logprobs_row.topk(top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token, float(logprobs_row[token]), top, rank)


def token_ranks(logprobs: torch.Tensor, tokens: list[int]) -> list[int]:
    """Each row's rank of its token, as vLLM counts it: the tokens at least as likely, itself included
    (1 for the likeliest; a tie takes the worse rank). logprobs [N, V], one token per row."""
    ids = torch.tensor(tokens, device=logprobs.device)[:, None]
    return (logprobs >= logprobs.gather(1, ids)).sum(dim=1).tolist()


def _allowed(r: SampleRow, edits: TokenEdits | None, V: int) -> torch.Tensor | None:
    """[V] bool: the tokens the row may sample, by its grammar's mask and its allowed_token_ids (both
    where both are given and some token is in both; the grammar's alone where none is), or None."""
    grammar = r.allowed[:V] if r.allowed is not None else None
    if edits is None or edits.only is None:
        return grammar
    if grammar is None:
        return edits.only[:V]
    both = edits.only[:V] & grammar
    return both if both.any() else grammar


def _ban(logits: torch.Tensor, i: int, banned: list[int], left: torch.Tensor | None, V: int) \
        -> torch.Tensor | None:
    """Row i's `banned` tokens off the table unless that leaves none of `left` (the tokens it may still
    sample, None: all; raw logits are finite, and only masks and bans make them -inf). Returns `left`
    after."""
    if not banned:
        return left
    after = torch.ones(V, dtype=torch.bool) if left is None else left.clone()
    after[banned] = False
    if not after.any():
        return left
    logits[i, banned] = float("-inf")
    return after


def _needs_edit(r: SampleRow) -> bool:
    return len(r.output_ids) < r.params.min_tokens or r.params.edits_logits or r.allowed is not None


def _apply_penalties(row: torch.Tensor, r: SampleRow, V: int) -> None:
    """In place on one [V] row of logits."""
    p = r.params
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted({t for t in (*r.prompt_ids, *r.output_ids) if 0 <= t < V}), dtype=torch.long,
                            device=row.device)
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
        counts = torch.bincount(torch.tensor([t for t in r.output_ids if 0 <= t < V], dtype=torch.long,
                                             device=row.device), minlength=V)
        row -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty * (counts > 0).to(row.dtype)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, V] logits -> probabilities after temperature, min-p, top-k and top-p, in vLLM's order (min-p
    on the tempered distribution; top-k keeps every token tied with the k-th, as vLLM cuts by value)."""
    dev = logits.device
    # (a temperature past the dtype's largest would be inf there: a banned -inf / inf is NaN, and a row of
    # NaN draws token 0 whatever its bans)
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    temps = temps.clamp_(max=torch.finfo(logits.dtype).max).to(device=dev, dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
    if (min_p > 0).any():
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        rank = torch.arange(V, device=dev).unsqueeze(0)
        k = torch.tensor([k if 0 < k < V else V for k in top_k], device=dev).unsqueeze(1)
        drop = sorted_logits < sorted_logits.gather(1, k - 1)  # (below the k-th's value)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # top-p: keep the smallest prefix whose mass reaches p (always the top token); rows with
        # top_p == 1 are left alone (a float32 cumsum can round up to 1 before the tail ends)
        before = probs.cumsum(-1) - probs
        p = torch.tensor(top_p, dtype=probs.dtype, device=dev).unsqueeze(1)
        drop |= (before >= p) & (p < 1) & (rank > 0)  # (the top token stays whatever top_p is)
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)
