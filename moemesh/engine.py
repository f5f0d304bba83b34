"""The in-process engine: the coordinator's scheduler driving every stage of the model in one
process, one step at a time. It is `moemesh generate`'s engine until the mesh runs the stages in
separate processes, and the baseline the mesh is measured against.

    step = scheduler.schedule()          which sequences, how many tokens each
    for stage in stages: forward          hidden/residual handed from stage to stage
    tokens = sample(logits)               last stage
    scheduler.update(step, tokens)        append, stop conditions, free blocks
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from coordinator.block_manager import BlockManager
from coordinator.scheduler import Scheduler, SchedulerConfig, Step
from coordinator.sequence import Sequence
from moemesh.config import ModelConfig
from moemesh.sampling import SamplingParams
from stage_worker.layers.parallel import TPGroup
from stage_worker.runner import StageRunner, StepInput
from stage_worker.sampler import sample


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from kv_memory_bytes
    kv_memory_bytes: int = 1 << 30
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    stage_layers: tuple[int, ...] | None = None  # layers per stage, e.g. (3, 5); None: one stage
    max_model_len: int | None = None  # None: the model's max_position_embeddings


def split_layers(num_layers: int, counts: tuple[int, ...] | None) -> list[range]:
    counts = counts or (num_layers,)
    if sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"layer partition {','.join(map(str, counts))} must be positive counts "
                         f"summing to the model's {num_layers} layers")
    starts = list(itertools.accumulate(counts, initial=0))
    return [range(a, b) for a, b in zip(starts, starts[1:])]


@dataclass
class Output:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str


class LLMEngine:
    def __init__(self, cfg: EngineConfig, progress: bool | None = None):
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model)
        mc = self.model_config
        stages = split_layers(mc.num_layers, cfg.stage_layers)
        num_blocks = cfg.num_kv_blocks or max(1, cfg.kv_memory_bytes // StageRunner.kv_bytes_per_block(
            mc, mc.num_layers, cfg.block_size, tp=TPGroup(), dtype=cfg.dtype))
        self.stages = [StageRunner(cfg.model, mc, layers, num_blocks, cfg.block_size, dtype=cfg.dtype,
                                   device=cfg.device, progress=progress) for layers in stages]
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs,
                            min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)),
            self.blocks, mc.eos_token_ids)
        self._ids = itertools.count()
        self.generator = torch.Generator()  # for requests without a seed
        self.generator.seed()  # non-deterministic, like an unseeded request should be

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
        seq = Sequence(next(self._ids), list(prompt_ids), params)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """Runs one scheduled step through every stage; returns the sequences that finished."""
        step = self.scheduler.schedule()
        if not step.items:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
            return []
        out = self._forward(step)
        rows = [item for item in step.items if item.sample]
        tokens = sample(out, [i.seq.params for i in rows], [len(i.seq.output_ids) for i in rows],
                        self.model_config.eos_token_ids, self.generator) if rows else []
        return self.scheduler.update(step, tokens)

    def _forward(self, step: Step) -> torch.Tensor:
        inputs = StepInput([i.token_ids for i in step.items], [i.context_len for i in step.items],
                           [list(i.seq.block_ids) for i in step.items], [i.sample for i in step.items])
        hidden = residual = None
        for stage in self.stages[:-1]:
            hidden, residual = stage.execute(inputs, hidden, residual)
        return self.stages[-1].execute(inputs, hidden, residual)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Output]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.scheduler.has_work():
            self.step()
        return [Output(s.prompt_ids, s.output_ids, s.finish_reason) for s in seqs]

