"""Runs one pipeline stage's slice of the model on one tensor rank: builds and loads the slice,
owns its KV cache, turns a step's schedule into a forward pass.

A step (`StepInput`) lists, per sequence, its new tokens, how many tokens its cache already holds,
its block table, and whether to sample after it. The first stage embeds the tokens; every stage
runs its layers on (hidden, residual) and hands the next stage the residual stream, hidden +
residual: the sum the next stage's first norm would compute, so one tensor crosses a stage
boundary instead of two (half the bytes; the same values in float32, within one rounding in
16-bit dtypes: the fused decode path adds in float32 and rounds the sum once); the last stage
returns logits of the rows to sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moemesh.config import ModelConfig
from moemesh.errors import ConfigError
from moemesh.settings import host_memory
from stage_worker.context import build_context, forward_context
from stage_worker.fused_decode import FusedDecode
from stage_worker.layers.attention import PagedAttention
from stage_worker.layers.parallel import TPGroup
from stage_worker.loader import load_model


@dataclass
class StepInput:
    token_ids: list[list[int]]  # new tokens per sequence
    context_lens: list[int]  # tokens already cached per sequence
    block_tables: list[list[int]]
    sample: list[bool]  # sample after this sequence's last new token

    @property
    def query_lens(self) -> list[int]:
        return [len(t) for t in self.token_ids]

    def sample_rows(self) -> list[int]:
        """Row (in the flat token batch) of each sampling sequence's last new token."""
        rows, end = [], 0
        for ids, sample in zip(self.token_ids, self.sample):
            end += len(ids)
            if sample:
                rows.append(end - 1)
        return rows


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """The KV cache, zeroed; a ConfigError naming the flags that size it where it cannot be had (more
    than the host's memory: the kernel would let a CPU allocation succeed and kill the process later)."""
    nbytes = math.prod(shape) * dtype.itemsize
    hint = (f"a KV cache of {shape[2]} blocks of {shape[3]} tokens ({nbytes / 2**30:.1f} GiB) on {device}: "
            f"lower --kv-memory, MOEMESH_KV_MEMORY in a compose file (or --num-kv-blocks, --block-size)")
    if torch.device(device).type == "cpu":
        memory = host_memory()
        if nbytes > memory:
            raise ConfigError(f"{hint}; this host has {memory / 2**30:.1f} GiB of memory")
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, OverflowError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
        raise ConfigError(f"{hint}; it could not be allocated: {str(e).splitlines()[0]}") from None


class StageRunner:
    def __init__(self, model_dir: str | Path, config: ModelConfig, layers: range, num_blocks: int,
                 block_size: int, tp: TPGroup = TPGroup(), dtype: torch.dtype = torch.float32,
                 device: str = "cpu", progress: bool | None = None, quant=None, moe_backend: str = "auto",
                 handoff: bool = False):
        """handoff: a stage after the first also holds the previous stage's last MLP (models/base.py)."""
        self.config, self.block_size, self.device, self.tp = config, block_size, torch.device(device), tp
        self.model_dir = model_dir
        # the positions a step can reach: a sequence holds a block of its own per block_size tokens
        self.max_positions = min(config.max_position_embeddings, num_blocks * block_size)
        self.model, self.load_stats = load_model(model_dir, config, layers, tp, dtype, device, quant=quant,
                                                 progress=progress, backend=moe_backend, handoff=handoff,
                                                 max_positions=self.max_positions)
        attn = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        kvh, D = attn[0].num_kv_heads, attn[0].head_dim
        # [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]; zeros: masked slots must be finite
        self.kv_cache = allocate_kv((len(attn), 2, num_blocks, block_size, kvh, D), dtype, device)
        for i, layer in enumerate(attn):
            layer.kv_cache = self.kv_cache[i]
        # decode steps in one native call for all the stage's layers, where every layer can take that path
        self.fused = FusedDecode.build(self.model, tp.size, dtype)

    @property
    def limits(self) -> tuple[int, int]:
        """(KV blocks, rotary positions) of this stage: what the native kernels' indices must stay inside
        (stage_worker/context.py `build_context` checks a step against them)."""
        return self.kv_cache.shape[2], self.max_positions

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, num_layers: int, block_size: int, tp: TPGroup,
                           dtype: torch.dtype) -> int:
        kvh = max(1, config.num_kv_heads // tp.size)
        return num_layers * 2 * block_size * kvh * config.head_dim * dtype.itemsize

    @torch.inference_mode()
    def execute(self, step: StepInput, stream: torch.Tensor | None = None, logit_rows: list[int] | None = None,
                greedy: bool = False, handoff_in: bool = False, handoff_out: bool = False):
        """stream: the previous stage's residual stream [T, H] (None on the first stage). Returns this
        stage's residual stream, or on the last stage logits [len(logit_rows), V] float32 (default
        rows: each sampling sequence's last token). greedy (on a model that `can_screen`): those
        rows' greedy tokens [len(logit_rows)] int64 instead, without every logit. The MLP hand-off
        (models/base.py): handoff_in, the stream still lacks the previous stage's last MLP (this
        stage runs it first); handoff_out, this stage's last layer stops after its attention."""
        if handoff_out and self.model.has_head:
            raise ValueError("the last stage has no next stage to hand its MLP to")
        if handoff_in and stream is None:
            raise ValueError("the first stage has no previous stage whose MLP it could run")
        # (a stream from the wire is a host tensor: a stage on a GPU computes on its own device)
        hidden, residual = (stream.to(self.device) if stream is not None else None), None
        native = self.model.backend == "native"
        ctx = build_context(step.query_lens, step.context_lens, step.block_tables, self.block_size, self.device,
                            self.limits if native else None)
        with forward_context(ctx):
            owned = self.model.has_embedding  # (the embedding's output is this step's own to overwrite)
            if owned:
                flat = [t for ids in step.token_ids for t in ids]
                hidden = self.model.embed(torch.tensor(flat, dtype=torch.long, device=self.device))
            elif handoff_in:
                hidden, residual = self.model.finish_handoff(hidden)
                owned = True  # (the MLP's fresh output)
            if self.fused is not None and len(ctx.groups) == 1 and ctx.groups[0].is_decode and not handoff_out:
                if not self.model.has_head:
                    return self.fused.forward(ctx, hidden, residual, stream=True, owned=owned)
                logit_rows = step.sample_rows() if logit_rows is None else logit_rows
                if self.fused.head is not None and logit_rows == list(range(len(ctx.positions))):  # all sampled
                    if greedy:
                        return self.fused.tokens(ctx, hidden, residual, owned)
                    return self.fused.logits(ctx, hidden, residual, owned)
                hidden, residual = self.fused.forward(ctx, hidden, residual, owned=owned)
            else:
                hidden, residual = self.model(hidden, residual, handoff=handoff_out)
        if not self.model.has_head:
            return hidden + residual
        if logit_rows is None:
            logit_rows = step.sample_rows()
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        if greedy:
            return self.model.compute_tokens(hidden[rows], residual[rows])
        return self.model.compute_logits(hidden[rows], residual[rows])
