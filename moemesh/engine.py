"""The in-process engine: the coordinator's core driving every stage of the model in one process,
one step at a time. `moemesh generate` without `--pp` runs on it, and it is the baseline the
mesh is measured against (the mesh runs the very same core and stage executors, over sockets).

    sched = core.next_schedule()           which sequences, how many tokens each, which blocks
    for stage in stages: stage.run(sched)  hidden/residual handed from stage to stage
    outputs = core.process_result(result)  last stage sampled; append, stop, free blocks
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from coordinator.core import EngineCore
from coordinator.scheduler import SchedulerConfig
from coordinator.sequence import Sequence
from moemesh.config import ModelConfig
from moemesh.protocol import RequestOutput
from moemesh.sampling import SamplingParams
from stage_worker.executor import StageExecutor
from stage_worker.layers.fp8 import resolve_quantization
from stage_worker.layers.parallel import TPGroup
from stage_worker.runner import StageRunner, StepInput


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
    quantization: str | None = None  # "fp8": quantize 16/32-bit weights at load (FP8 checkpoints: automatic)
    moe_backend: str = "auto"  # auto: Triton kernels on CUDA, vectorised torch on CPU

    def scheduler_config(self, model: ModelConfig) -> SchedulerConfig:
        return SchedulerConfig.for_model(self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len,
                                         model.max_position_embeddings)


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
        self.model_config = mc = ModelConfig.from_dir(cfg.model)
        stages = split_layers(mc.num_layers, cfg.stage_layers)
        num_blocks = cfg.num_kv_blocks or max(1, cfg.kv_memory_bytes // StageRunner.kv_bytes_per_block(
            mc, mc.num_layers, cfg.block_size, TPGroup(), cfg.dtype))
        self.generator = torch.Generator(device=cfg.device)  # for requests without a seed
        self.generator.seed()  # non-deterministic, as an unseeded request should be
        quant = resolve_quantization(mc, cfg.quantization)
        self.stages = [
            StageExecutor(StageRunner(cfg.model, mc, layers, num_blocks, cfg.block_size, dtype=cfg.dtype,
                                      device=cfg.device, progress=progress, quant=quant,
                                      moe_backend=cfg.moe_backend),
                          mc.eos_token_ids, self.generator)
            for layers in stages
        ]
        self.core = EngineCore(cfg.scheduler_config(mc), num_blocks, cfg.block_size, mc.eos_token_ids,
                               mc.vocab_size)
        self._ids = itertools.count()

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def blocks(self):
        return self.core.blocks

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        return self.core.add(request_id or str(next(self._ids)), prompt_ids, params)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step through every stage; returns the requests' new outputs."""
        sched = self.core.next_schedule()
        if sched is None:
            if self.core.has_work():
                raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
            return []
        hidden = residual = None
        for stage in self.stages[:-1]:
            hidden, residual = stage.run(sched, hidden, residual)
        return self.core.process_result(self.stages[-1].run(sched, hidden, residual))

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Logits [len(prompt), V] at every prompt position, through every stage, for tests and
        benchmarks; the engine must be idle (its first blocks serve as scratch)."""
        blocks = -(-len(prompt) // self.cfg.block_size)
        if self.core.has_work() or blocks > self.blocks.num_blocks:
            raise RuntimeError("prompt_logits needs an idle engine with room for the prompt")
        step = StepInput([prompt], [0], [list(range(blocks))], [True])
        out = (None, None)
        for stage in self.stages:
            out = stage.runner.execute(step, *out, logit_rows=list(range(len(prompt))))
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Output]:
        params = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.core.has_work():
            self.step()
        return [Output(s.prompt_ids, s.output_ids, s.finish_reason) for s in seqs]
