"""The in-process engine: the coordinator's scheduling loop (`StepLoop`, the same EngineCore, the same
in-flight rule and KV sizing) driving every stage of the model in this process through the pipeline
interface the mesh implements over ZeroMQ. `moemesh generate` without `--pp` runs on it, and it is
the baseline the mesh is measured against.

    for sched in loop.issue(): pipeline.send(sched)     up to max_in_flight (default: stages) microbatches
    outputs = loop.take(pipeline.poll())                the oldest runs through every stage; tokens appended
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from coordinator.sequence import Sequence
from coordinator.step_loop import StepLoop, check_num_steps, in_flight_limit, make_core
from moemesh.config import ModelConfig, resolve_dtype
from moemesh.errors import ConfigError
from moemesh.layout import MlpHandoff, resolve_layout
from moemesh.protocol import RequestOutput
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings
from moemesh.step_costs import partition_costs
from moemesh_kernels.backend import check_device
from moemesh_kernels.memory import use_huge_pages
from stage_worker.in_process import InProcessPipeline
from stage_worker.runner import StepInput
from stage_worker.tensors import torch_dtype


@dataclass
class Output:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str


class LLMEngine:
    def __init__(self, settings: EngineSettings, progress: bool | None = None, device: str | None = None):
        self.settings = settings
        use_huge_pages(not settings.no_huge_pages)
        device = device or settings.device
        check_device(device)
        self.model_config = mc = ModelConfig.from_dir(settings.model)
        if settings.tp > 1 or settings.expert_parallel:
            raise ConfigError("the in-process engine runs whole layers; tensor and expert parallelism need the mesh")
        partition = settings.layer_partition
        pp = len(partition) if isinstance(partition, (tuple, list)) else settings.pp
        costs = partition_costs(settings, settings.model, mc, pp, threads=settings.threads or torch.get_num_threads(),
                                device=device)
        self.layout = resolve_layout(mc, pp, 1, partition, False, settings.quantization, costs,
                                     handoff=not settings.no_mlp_handoff)
        check_num_steps(settings, self.layout.pp, 1)
        self.dtype = torch_dtype(resolve_dtype(settings.dtype, mc, device))
        num_blocks = settings.kv_blocks(InProcessPipeline.bytes_per_block(mc, settings.block_size, self.dtype))
        # the MLP hand-off (moemesh.layout.MlpHandoff): None where off or where no step could use it
        handoff = None if settings.no_mlp_handoff else MlpHandoff.for_layout(mc, self.layout.stages)
        self.pipeline = InProcessPipeline(settings.model, mc, self.layout.stages, num_blocks, settings.block_size,
                                          self.dtype, device, self.layout.quantization, settings.moe_backend, progress,
                                          handoff=handoff)
        self.core = make_core(settings, mc, num_blocks, self.layout.pp, handoff=handoff)
        self.loop = StepLoop(self.core, in_flight_limit(settings, self.layout.pp))
        self._ids = itertools.count()

    @property
    def stages(self):
        return self.pipeline.stages

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def blocks(self):
        return self.core.blocks

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        return self.core.add(request_id or str(next(self._ids)), prompt_ids, params)

    def step(self) -> list[RequestOutput]:
        """Fills the pipeline, runs its oldest microbatch through every stage; the requests' new outputs."""
        for sched in self.loop.issue():
            self.pipeline.send(sched)
        if self.loop.stalled():
            raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
        if not self.core.in_flight:
            return []
        try:
            result = self.pipeline.poll()
        except BaseException:  # a stage raised: what the steps in flight were to write is not there;
            self.core.requeue_all()  # recompute every sequence, share no block
            self.pipeline.drop(self.core.next_step_id)
            raise
        return self.loop.take(result)

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        """Logits [len(prompt), V] at every prompt position, through every stage, for tests and
        benchmarks; the engine must be idle (its first blocks serve as scratch)."""
        blocks = -(-len(prompt) // self.settings.block_size)
        if self.core.has_work() or blocks > self.blocks.num_blocks:
            raise RuntimeError("prompt_logits needs an idle engine with room for the prompt")
        self.blocks.reset_cache()  # its scratch blocks may hold a cached prefix: not any more
        step = StepInput([prompt], [0], [list(range(blocks))], [True])
        out = None  # the residual stream between stages, then the logits
        for stage in self.stages:
            out = stage.runner.execute(step, out, logit_rows=list(range(len(prompt))))
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Output]:
        """Every prompt to its end, outputs in the prompts' order. If one is refused or a step fails, the
        requests this call added are aborted (none of them is left to run in a later call) and the error
        raised."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts and {len(params)} sampling params")
        seqs = []
        try:
            for p, sp in zip(prompts, params):
                seqs.append(self.add_request(p, sp))
            while self.core.has_work():
                self.step()
        except BaseException:
            for seq in seqs:
                self.core.abort(seq.request_id)
            raise
        return [Output(s.prompt_ids, s.output_ids, s.finish_reason) for s in seqs]
