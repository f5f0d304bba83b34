"""The scheduling loop, one for every engine: the mesh coordinator and the in-process `LLMEngine`
both run it against a pipeline with a `send(schedule)` (`coordinator.server.ZmqPipeline`: to every
stage worker over ZeroMQ; `stage_worker.in_process.InProcessPipeline`: the stages in this process),
whose last stage's StepResults come back in issue order.

    for sched in loop.issue():        up to `limit` microbatches in flight, the active sequences
        pipeline.send(sched)          shared among them so that every stage has work
    ... the last stage's StepResult comes back (in issue order) ...
    outputs = loop.take(result)       tokens appended, requests finished, blocks freed

It also counts what the coordinator itself costs: microbatches issued and its CPU time on them;
and it keeps the timeline's coordinator row: each step from its schedule going out to its result
being taken.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from collections import deque
from typing import Iterator

import msgspec

from coordinator.core import EngineCore
from coordinator.ngram import NgramConfig
from coordinator.scheduler import SchedulerConfig
from moemesh.config import ModelConfig
from moemesh.errors import ConfigError
from moemesh.layout import MlpHandoff
from moemesh.log import get_logger
from moemesh.protocol import TIMELINE_SPANS, RequestOutput, Schedule, StepResult, StepSpan
from moemesh.settings import SchedulerSettings


def in_flight_limit(settings: SchedulerSettings, pp: int) -> int:
    """Microbatches in the pipeline at once: --max-in-flight, else one per stage."""
    return settings.max_in_flight or pp


# vLLM's --speculative-config keys -> the settings they stand for
_VLLM_SPECULATIVE = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "ngram_prompt_lookup_max",
                     "prompt_lookup_min": "ngram_prompt_lookup_min",
                     "disable_by_batch_size": "speculative_disable_by_batch_size"}


def _from_vllm(settings: SchedulerSettings, given: dict) -> SchedulerSettings:
    """The settings with --speculative-config (vLLM's JSON form, `given` as parsed) applied to the flags
    it stands for."""
    if given.get("method", "ngram") != "ngram":
        raise ConfigError(f"--speculative-config: method {given['method']!r} is not served here: only ngram "
                          f"(prompt lookup; no draft models, EAGLE or MTP)")
    unknown = sorted(set(given) - {"method", *_VLLM_SPECULATIVE})
    if unknown:
        raise ConfigError(f"--speculative-config: {', '.join(unknown)} not known here (method, "
                          f"{', '.join(_VLLM_SPECULATIVE)})")
    if settings.num_speculative_tokens:
        raise ConfigError("give --speculative-config or --num-speculative-tokens, not both")
    values = {}
    for key, name in _VLLM_SPECULATIVE.items():
        if key in given:
            if not isinstance(given[key], int) or isinstance(given[key], bool) or given[key] < 1:
                raise ConfigError(f"--speculative-config: {key} must be a positive integer")
            values[name] = given[key]
    if "num_speculative_tokens" not in values:
        raise ConfigError("--speculative-config: num_speculative_tokens is required")
    if "prompt_lookup_max" in given and "prompt_lookup_min" not in given:  # (a max below the default min takes it)
        values["ngram_prompt_lookup_min"] = min(settings.ngram_prompt_lookup_min, given["prompt_lookup_max"])
    return dataclasses.replace(settings, **values)


_NGRAM_FLAGS = ("ngram_prompt_lookup_min", "ngram_prompt_lookup_max", "speculative_disable_by_batch_size")


@functools.lru_cache(maxsize=8)
def _unused(flags: str) -> None:  # (once a process: every command checks its settings more than once)
    get_logger("coordinator").warning(f"{flags} given without --num-speculative-tokens: speculative decoding "
                                      f"is off, and they do nothing")


def ngram_config(settings: SchedulerSettings) -> NgramConfig | None:
    """Speculative decoding's settings (--num-speculative-tokens and its flags, or vLLM's
    --speculative-config), checked; None when it is off."""
    given = json.loads(settings.speculative_config) if settings.speculative_config is not None else {}
    if settings.speculative_config is not None:
        settings = _from_vllm(settings, given)

    def name(field: str) -> str:  # (what the user gave: a flag, or a key of --speculative-config's JSON)
        key = next((k for k, v in _VLLM_SPECULATIVE.items() if v == field), None)
        return f"--speculative-config's {key}" if key in given else "--" + field.replace("_", "-")

    lo, hi = settings.ngram_prompt_lookup_min, settings.ngram_prompt_lookup_max
    if lo > hi:  # (wrong whether or not drafts are on)
        raise ConfigError(f"{name('ngram_prompt_lookup_min')} {lo} is more than {name('ngram_prompt_lookup_max')} {hi}")
    if not settings.num_speculative_tokens:
        if settings.speculative_sampling:  # (it would do nothing, silently)
            raise ConfigError("--speculative-sampling drafts for sampled requests too: it needs "
                              "--num-speculative-tokens (or --speculative-config)")
        defaults = {f.name: f.default for f in dataclasses.fields(SchedulerSettings)}
        given = [f for f in _NGRAM_FLAGS if getattr(settings, f) != defaults[f]]
        if given:  # (--num-speculative-tokens 0 turns drafts off and may leave them set: said, not refused)
            _unused(", ".join("--" + f.replace("_", "-") for f in given))
        return None
    if settings.num_scheduler_steps > 1:
        raise ConfigError(f"{name('num_speculative_tokens')} and --num-scheduler-steps {settings.num_scheduler_steps} "
                          f"are two ways to take several tokens a step: choose one")
    return NgramConfig(settings.num_speculative_tokens, lo, hi, settings.speculative_disable_by_batch_size,
                       settings.speculative_sampling)


def check_num_steps(settings: SchedulerSettings, pp: int, tp: int) -> None:
    """Several decode steps per schedule need a stage that embeds the tokens it samples and is the
    only rank to sample them (a pipeline of one stage of one rank), and a step that holds every
    running sequence (one microbatch in flight). Speculative decoding's settings are checked here too
    (`ngram_config`): every command that starts an engine or a coordinator calls this first."""
    n = settings.num_scheduler_steps
    if n > 1 and (pp > 1 or tp > 1):
        raise ConfigError(f"--num-scheduler-steps {n} needs a pipeline of one stage of one rank (--pp 1 --tp 1), "
                          f"not --pp {pp} --tp {tp}")
    if n > 1 and in_flight_limit(settings, pp) > 1:
        raise ConfigError(f"--num-scheduler-steps {n} runs one microbatch of every sequence: it cannot take "
                          f"--max-in-flight {settings.max_in_flight}")
    ngram_config(settings)  # (and the drafts' settings, before any process starts)


def make_core(settings: SchedulerSettings, model: ModelConfig, num_blocks: int, pp: int = 1, tp: int = 1,
              handoff: MlpHandoff | None = None) -> EngineCore:
    """The EngineCore of a pipeline of pp stages of tp ranks whose smallest stage pool holds
    `num_blocks` (block ids are shared across stages); `handoff`: the MLP hand-off, whose MLPs the
    core hands over step by step (the stages after them hold them), or None."""
    config = SchedulerConfig.for_model(settings.max_batched_tokens, settings.max_seqs, settings.max_model_len,
                                       model.max_position_embeddings)
    check_num_steps(settings, pp, tp)
    config = dataclasses.replace(config, num_steps=settings.num_scheduler_steps, ngram=ngram_config(settings))
    # a context the KV cache cannot hold could never be served: every request that asks for it would be
    # refused (a chat without max_tokens asks for all of it), so the limit is what the cache holds
    capacity = num_blocks * settings.block_size + 1  # (a sequence's last token is never cached)
    if config.max_model_len > capacity:
        get_logger("coordinator").warning(
            "the KV cache holds fewer tokens than the context length: requests are limited to what it holds "
            "(raise --kv-memory, or set --max-model-len to say so)",
            extra={"fields": {"max_model_len": config.max_model_len, "kv_cache_tokens": capacity}})
    return EngineCore(dataclasses.replace(config, max_model_len=min(config.max_model_len, capacity)), num_blocks,
                      settings.block_size, model.eos_token_ids, model.vocab_size,
                      prefix_caching=not settings.no_prefix_caching, context_limit=config.max_model_len,
                      handoff=handoff)


class StepLoop:
    def __init__(self, core: EngineCore, limit: int):
        self.core, self.limit = core, max(1, limit)
        self.steps = 0  # microbatches issued
        self.step_seconds = 0.0  # CPU time scheduling them and taking their results
        self.spans: deque[StepSpan] = deque(maxlen=TIMELINE_SPANS)  # the steps taken, newest last
        self._open: dict[int, tuple[StepSpan, float]] = {}  # step id -> its span begun, perf_counter then

    def issue(self) -> Iterator[Schedule]:
        """The schedules to send now: until `limit` microbatches are in flight or nothing can run."""
        core = self.core
        while len(core.in_flight) < self.limit and core.has_work():
            started = time.thread_time()
            active = len(core.scheduler.running) + len(core.scheduler.waiting)
            sched = core.next_schedule(max_seqs=max(1, math.ceil(active / self.limit)))
            self.step_seconds += time.thread_time() - started
            if sched is None:
                return
            self.steps += 1
            if len(self._open) > 4 * self.limit:  # (steps a recovery abandoned never come back)
                self._open = {s: begun for s, begun in self._open.items() if s in core.in_flight}
            self._open[sched.step_id] = StepSpan.of(sched, time.time()), time.perf_counter()
            yield sched

    def take(self, result: StepResult) -> list[RequestOutput]:
        """A step's result -> the outputs it produced. ValueError for a result that is not in flight
        or lacks a sampled sequence (nothing changes then)."""
        started = time.thread_time()
        try:
            outputs = self.core.process_result(result)
        finally:
            self.step_seconds += time.thread_time() - started
        if (begun := self._open.pop(result.step_id, None)) is not None:
            span, at = begun
            self.spans.append(msgspec.structs.replace(span, seconds=time.perf_counter() - at))
        return outputs

    def stalled(self) -> bool:
        """Work waits but nothing is in flight or can be issued: the KV cache is too small for any of it."""
        return self.core.has_work() and not self.core.in_flight
