"""Every stage of a model in this process: the in-process side of the pipeline interface the mesh's
ZeroMQ transport implements (`coordinator.step_loop.Pipeline`). Schedules are queued by `send` and
run in order by `poll`, each through every stage, hidden state handed from stage to stage."""

from __future__ import annotations

from collections import deque

import torch

from moemesh.config import ModelConfig
from moemesh.layout import MlpHandoff
from moemesh.protocol import Schedule, StepResult
from stage_worker.executor import StageExecutor
from stage_worker.layers.fp8 import resolve_quantization
from stage_worker.layers.parallel import TPGroup
from stage_worker.runner import StageRunner


class InProcessPipeline:
    def __init__(self, model_dir: str, model: ModelConfig, stages: list[range], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: str = "cpu", quantization: str | None = None, moe_backend: str = "auto",
                 progress: bool | None = None, handoff: MlpHandoff | None = None):
        """handoff: the MLP hand-off, whose MLPs the stages after them also hold (or None)."""
        quant = resolve_quantization(model, quantization)
        self.stages = [
            StageExecutor(StageRunner(model_dir, model, layers, num_blocks, block_size, dtype=dtype, device=device,
                                      progress=progress, quant=quant, moe_backend=moe_backend,
                                      handoff=handoff is not None and handoff.holds(layers)),
                          model.eos_token_ids)
            for layers in stages
        ]
        self.queue: deque[Schedule] = deque()

    @staticmethod
    def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """One pool for every layer: the engine is one 'worker' holding the whole model."""
        return StageRunner.kv_bytes_per_block(model, model.num_layers, block_size, TPGroup(), dtype)

    def send(self, sched: Schedule) -> None:
        self.queue.append(sched)

    def poll(self) -> StepResult:
        """Runs the oldest schedule sent through every stage; its StepResult."""
        sched = self.queue.popleft()
        stream = None
        for stage in self.stages[:-1]:
            stream = stage.run(sched, stream)
        return self.stages[-1].run(sched, stream)

    def drop(self, first_step: int) -> None:
        """Forgets the schedules not yet run (their steps were abandoned), and the state of every
        sequence admitted before `first_step`: the core re-admits them all from that step on."""
        self.queue.clear()
        for stage in self.stages:
            stage.reset(first_step)
