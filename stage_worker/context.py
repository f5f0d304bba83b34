"""The per-step context: batch metadata that attention reads, set once per forward by the runner.

A step holds any mix of sequences: prompts (whole or a chunk continuing an earlier chunk) and
decodes (one new token). Tokens of a sequence are contiguous in the flat token batch. For attention,
sequences are grouped: decodes (one query each) in one batch, prefill chunks padded in another, so
that each layer runs one attention call per group rather than one per sequence.

Legend: T = tokens in the step, B = sequences in a group, Q = longest query in the group,
L = longest context (cached + new) in the group, rounded up to whole KV blocks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class AttentionGroup:
    token_index: torch.Tensor  # [B, Q] long: row of each query in the flat batch (padding: any valid row)
    valid: torch.Tensor  # [B, Q] bool: real query (not padding)
    block_table: torch.Tensor  # [B, L / block_size] long: KV blocks holding each context (padding: block 0)
    is_decode: bool
    kv_len: torch.Tensor  # [B] long: keys of each sequence after this step (cached + new)
    context_len: torch.Tensor  # [B] long: keys cached before this step (the first query's position)
    num_keys: int  # L: the keys gathered per sequence (whole blocks)
    _mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, Q, L] float: 0 where the query may attend to the key, -inf elsewhere (additive: SDPA's
        fast path). Built on first use: the native decode kernel never needs it."""
        if self._mask is None:
            # query j of sequence b sits at position context_len[b] + j and sees keys at positions <= that
            dev = self.context_len.device
            q_pos = self.context_len.unsqueeze(1) + torch.arange(self.token_index.shape[1], device=dev)  # [B, Q]
            allowed = torch.arange(self.num_keys, device=dev).view(1, 1, -1) <= q_pos.unsqueeze(2)  # [B, Q, L]
            self._mask = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf")).unsqueeze(1)
        return self._mask


@dataclass
class ForwardContext:
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    groups: list[AttentionGroup]


_current: ForwardContext | None = None


def get_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside a forward context")
    return _current


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    if _current is not None:
        raise RuntimeError("forward contexts do not nest")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def build_context(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                  block_size: int, device: torch.device | str = "cpu",
                  limits: tuple[int, int] | None = None) -> ForwardContext:
    """Metadata for one step.

    query_lens[i]: new tokens of sequence i in this step; context_lens[i]: tokens already in its
    cache (the new ones start at that position); block_tables[i]: its KV block ids, covering
    context_lens[i] + query_lens[i] tokens. limits: (KV blocks, rotary positions) of the stage:
    refuse a step whose KV slots, decode block tables or positions reach outside them (ValueError;
    a block table too short for its own context fails earlier, with IndexError, in either case
    before any kernel runs).
    The native kernels trust these indices (torch's indexing checks its own), so a stage that runs
    them passes its limits and each step is checked once, here, rather than in every layer.
    """
    if query_lens and query_lens.count(1) == len(query_lens):
        ctx = _decode_context(context_lens, block_tables, block_size, limits)
    else:
        positions, slots = [], []
        starts = []
        t = 0
        for q, c, blocks in zip(query_lens, context_lens, block_tables):
            starts.append(t)
            t += q
            pos = range(c, c + q)
            positions.extend(pos)
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        prefill = [i for i, q in enumerate(query_lens) if q > 1]
        groups = [
            _group(idx, starts, query_lens, context_lens, block_tables, block_size, is_decode=d)
            for idx, d in ((decode, True), (prefill, False)) if idx
        ]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        ctx = ForwardContext(as_long(positions), as_long(slots), groups)
        if limits is not None:
            _check(positions, slots, [g.block_table.view(-1).tolist() for g in groups if g.is_decode], limits,
                   block_size)
    if str(device) != "cpu":
        ctx = _to_device(ctx, device)
    return ctx


def _decode_context(context_lens: list[int], block_tables: list[list[int]], block_size: int,
                    limits: tuple[int, int] | None) -> ForwardContext:
    """`build_context` for a pure decode step (one new token per sequence), the step a running batch
    repeats: the same metadata as views of one tensor built at once (the general path builds eight)."""
    B = len(context_lens)
    n = (max(context_lens) + block_size) // block_size  # blocks covering the longest context + 1
    slots = [blocks[c // block_size] * block_size + c % block_size for c, blocks in zip(context_lens, block_tables)]
    flat = [*context_lens, *slots, *(c + 1 for c in context_lens), *range(B)]
    table_start = len(flat)
    for blocks in block_tables:  # each table cut or padded (block 0) to n blocks
        flat += blocks[:n] if len(blocks) >= n else blocks + [0] * (n - len(blocks))
    if limits is not None:
        _check(context_lens, slots, [flat[table_start:]], limits, block_size)
    buf = torch.tensor(flat, dtype=torch.long)
    positions = buf[:B]
    group = AttentionGroup(buf[3 * B:table_start].view(B, 1), torch.ones(B, 1, dtype=torch.bool),
                           buf[table_start:].view(B, n), True, buf[2 * B:3 * B], positions, n * block_size)
    return ForwardContext(positions, buf[B:2 * B], [group])


def _group(idx, starts, query_lens, context_lens, block_tables, block_size, is_decode):
    qs_l = [query_lens[i] for i in idx]
    cs_l = [context_lens[i] for i in idx]
    Q, L = max(qs_l), max(q + c for q, c in zip(qs_l, cs_l))
    n_blocks = -(-L // block_size)
    rows = []  # each table cut or padded (block 0) to n_blocks: one tensor built at once
    for i in idx:
        blocks = block_tables[i]
        rows.append(blocks[:n_blocks] if len(blocks) >= n_blocks else blocks + [0] * (n_blocks - len(blocks)))
    table = torch.tensor(rows, dtype=torch.long)
    cs, qs = torch.tensor(cs_l), torch.tensor(qs_l)
    total = cs + qs
    if Q == 1:
        token_index = torch.tensor([starts[i] for i in idx]).unsqueeze(1)
        valid = torch.ones(len(idx), 1, dtype=torch.bool)
    else:
        q_off = torch.arange(Q)
        token_index = torch.tensor([starts[i] for i in idx]).unsqueeze(1) + q_off  # [B, Q]
        valid = q_off < qs.unsqueeze(1)
        token_index = torch.where(valid, token_index, token_index[:, :1])
    # keys are gathered whole blocks at a time: L rounds up to whole blocks
    return AttentionGroup(token_index, valid, table, is_decode, total, cs, n_blocks * block_size)


def _check(positions: list[int], slots: list[int], decode_tables: list[list[int]], limits: tuple[int, int],
           block_size: int) -> None:
    """build_context's limits, on the step's own lists (a decode group's context lengths are its
    positions, and its tables are as wide as its longest context needs, so the positions and the
    block ids bound its lengths too)."""
    num_blocks, max_positions = limits
    if positions and (min(positions) < 0 or max(positions) >= max_positions
                      or min(slots) < 0 or max(slots) >= num_blocks * block_size):
        raise ValueError("a KV slot or position of this step is outside the cache or the rotary table")
    for ids in decode_tables:
        if ids and (min(ids) < 0 or max(ids) >= num_blocks):
            raise ValueError("a block table of this step reaches outside the KV cache")


def _to_device(ctx: ForwardContext, device) -> ForwardContext:
    groups = [AttentionGroup(g.token_index.to(device), g.valid.to(device), g.block_table.to(device), g.is_decode,
                             g.kv_len.to(device), g.context_len.to(device), g.num_keys) for g in ctx.groups]
    return ForwardContext(ctx.positions.to(device), ctx.slot_mapping.to(device), groups)
