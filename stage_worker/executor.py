"""Runs the coordinator's schedules on one stage. Every stage keeps each running sequence's block
table (schedules carry only the blocks added since the last one); the last stage also keeps what
sampling needs of each sequence (its parameters and the tokens fed so far) and turns logits into a
StepResult.

A shared head (`head_share` > 0, pipelines of two or more stages): the first stage's tensor rank 0
also samples the first `shipped_rows(n, head_share)` of each step's n sampled rows. The last stage
samples the rest and hands them, with the final norm's output of the shipped rows, to the first
stage (`HeadHandoff`), which multiplies those by its own copy of the lm_head, samples them (it keeps the
same sampling state) and returns the step's whole StepResult (`finish`). Decode steps pay the head
on every row and prompt chunks almost never; a contiguous split of the layers cannot be even for
both, a share of the head can move with the first and stay out of the second (docs/benchmarks.md).

This is the one code path for a stage, whether it runs in a worker process on the mesh or in the
in-process engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moemesh.protocol import BlockTables, PromptLogprobs, SampledToken, Schedule, StepResult, shipped_rows
from moemesh.sampling import SamplingParams
from stage_worker.runner import StageRunner, StepInput
from stage_worker.sampler import SampleRow, sample, token_logprobs


@dataclass
class SeqState:
    params: SamplingParams
    prompt_len: int
    tokens: list[int]  # every token fed so far, from position 0
    prompt_ids: list[int] | None  # the whole prompt, when prompt logprobs are wanted


@dataclass
class HeadHandoff:
    """The last stage's half of a step whose head is shared: the tokens it sampled, and the final
    norm's output of the rows the first stage samples [k, H]."""
    partial: StepResult
    normed: torch.Tensor


class StageExecutor:
    def __init__(self, runner: StageRunner, eos_token_ids: tuple[int, ...] = (),
                 generator: torch.Generator | None = None, head_share: float = 0.0):
        self.runner = runner
        self.is_last = runner.model.has_head
        # head_share > 0: this stage is the last, or the first stage's rank that holds the shared lm_head
        # (of a pipeline of two stages or more: one stage holding the whole model shares with nobody)
        model = runner.model
        self.head_share = head_share if (model.has_lm_head and not (model.has_head and model.has_embedding)) else 0.0
        self.samples = self.is_last or self.head_share > 0
        self.eos_token_ids = eos_token_ids
        if generator is None and self.samples:  # for requests without a seed: different in every process
            generator = torch.Generator(device=runner.device)
            generator.seed()
        self.generator = generator
        self.seqs: dict[int, SeqState] = {}  # (a stage that samples)
        self.pending: dict[int, list[int]] = {}  # (first stage, shared head) step -> the sequences it samples
        self.block_tables = BlockTables()
        self.busy_seconds = 0.0

    def reset(self, first_step: int) -> None:
        """A new epoch from `first_step` on: every sequence of it is admitted afresh by a step at or
        after that, so what was admitted before is stale (a sequence that ended in the lost epoch,
        whose forget never came). What a step of the new epoch already admitted stays: a worker
        that learns of the epoch late may have run some."""
        for seq_id in self.block_tables.drop_admitted_before(first_step):
            self.seqs.pop(seq_id, None)
        self.pending = {s: seqs for s, seqs in self.pending.items() if s >= first_step}

    def run(self, sched: Schedule, stream: torch.Tensor | None = None):
        """The previous stage's residual stream (None on the first stage) -> this stage's for the next
        stage, or on the last stage a StepResult (a HeadHandoff where the head is shared)."""
        start = time.perf_counter()
        try:
            step = StepInput([w.token_ids for w in sched.seqs], [w.context_len for w in sched.seqs],
                             self._apply(sched), [w.sample for w in sched.seqs])
            if not self.is_last:
                out = self.runner.execute(step, stream)
                if self.head_share:  # (the first stage) its share of the rows, sampled in `finish`
                    rows = self._track(sched)[0]
                    self.pending[sched.step_id] = [seq_id for _, seq_id in rows[:shipped_rows(len(rows),
                                                                                               self.head_share)]]
                return out
            return self._sample(sched, step, stream)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def finish(self, step_id: int, partial: StepResult, normed: torch.Tensor) -> StepResult:
        """(The first stage, shared head) the last stage's HeadHandoff of a step this stage ran -> the
        step's StepResult. ValueError for a step not waiting here or rows that do not match it."""
        start = time.perf_counter()
        try:
            seq_ids = self.pending.get(step_id)
            if seq_ids is None:
                raise ValueError(f"a handoff for step {step_id}, which is not waiting for one here")
            if normed.shape[0] != len(seq_ids):
                raise ValueError(f"the handoff of step {step_id} has {normed.shape[0]} rows, the step "
                                 f"samples {len(seq_ids)} here")
            del self.pending[step_id]
            sampled = []
            if seq_ids:
                logits = self.runner.shared_logits(normed)
                tokens, logprobs = sample(logits, [self._row(s) for s in seq_ids], self.eos_token_ids,
                                          self.generator)
                sampled = [SampledToken(s, t, lp) for s, t, lp in zip(seq_ids, tokens, logprobs)]
            return StepResult(step_id, sampled + partial.sampled, partial.prompt_logprobs,
                              busy_seconds=partial.busy_seconds)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _apply(self, sched: Schedule) -> list[list[int]]:
        """Forgets the sequences that ended; the step's block tables, brought up to date."""
        for seq_id in sched.forget:
            self.seqs.pop(seq_id, None)
        return self.block_tables.apply(sched)

    def _sample(self, sched: Schedule, step: StepInput, stream) -> StepResult | HeadHandoff:
        sample_rows, prompt_rows = self._track(sched)
        shipped = []
        if self.head_share:
            k = shipped_rows(len(sample_rows), self.head_share)
            shipped, sample_rows = sample_rows[:k], sample_rows[k:]
        out = self.runner.execute(step, stream, logit_rows=[r for r, _ in sample_rows] + [r for r, _, _ in prompt_rows],
                                  shipped_rows=[r for r, _ in shipped] if self.head_share else None)
        logits, normed = out if self.head_share else (out, None)
        rows = [self._row(seq_id) for _, seq_id in sample_rows]
        tokens, logprobs = sample(logits[:len(sample_rows)], rows, self.eos_token_ids, self.generator)
        sampled = [SampledToken(seq_id, t, lp) for (_, seq_id), t, lp in zip(sample_rows, tokens, logprobs)]
        result = StepResult(sched.step_id, sampled, self._prompt_logprobs(logits[len(sample_rows):], prompt_rows),
                            busy_seconds=self.busy_seconds)
        return result if normed is None else HeadHandoff(result, normed)

    def _track(self, sched: Schedule) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """Brings the sampling state of the step's sequences up to date; -> the rows it samples
        (row, seq) and the rows whose prompt logprobs it computes (row, seq, position predicted)."""
        sample_rows, prompt_rows = [], []
        row = 0
        for w in sched.seqs:
            if w.params is not None:  # admitted: the tokens before this chunk came from the prefix cache
                self.seqs[w.seq_id] = SeqState(w.params, w.prompt_len, list(w.cached_ids or []), w.prompt_ids)
            st = self.seqs.get(w.seq_id)
            if st is None:
                raise ValueError(f"step {sched.step_id}: sequence {w.seq_id} has no sampling state "
                                 f"(its first chunk did not carry params)")
            if len(st.tokens) < w.context_len:
                raise ValueError(f"step {sched.step_id}: sequence {w.seq_id} starts at {w.context_len} but only "
                                 f"{len(st.tokens)} of its tokens are known here")
            del st.tokens[w.context_len:]
            st.tokens.extend(w.token_ids)
            if st.prompt_ids is not None:  # row at position q predicts prompt token q + 1
                for q in range(w.context_len, min(w.context_len + len(w.token_ids), st.prompt_len - 1)):
                    prompt_rows.append((row + q - w.context_len, w.seq_id, q + 1))
            row += len(w.token_ids)
            if w.sample:
                sample_rows.append((row - 1, w.seq_id))
        return sample_rows, prompt_rows

    def _row(self, seq_id: int) -> SampleRow:
        st = self.seqs[seq_id]
        # the prompt is copied out only for the repetition penalty (the one user of it)
        prompt = st.tokens[:st.prompt_len] if st.params.repetition_penalty != 1 else []
        return SampleRow(st.params, prompt, st.tokens[st.prompt_len:])

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows) -> list[PromptLogprobs]:
        if not prompt_rows:
            return []
        lp = torch.log_softmax(logits, dim=-1)
        out: dict[int, PromptLogprobs] = {}
        for i, (_, seq_id, pos) in enumerate(prompt_rows):
            st = self.seqs[seq_id]
            entry = token_logprobs(lp[i], st.prompt_ids[pos], st.params.prompt_logprobs)
            if seq_id not in out:
                out[seq_id] = PromptLogprobs(seq_id, pos, [])
            out[seq_id].logprobs.append(entry)
        return list(out.values())
