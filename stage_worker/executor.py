"""Runs the coordinator's schedules on one stage. Every stage keeps each running sequence's block
table (schedules carry only the blocks added since the last one); the last stage also keeps what
sampling needs of each sequence (its parameters and the tokens fed so far) and turns logits into a
StepResult (a structured output's grammar masking its logits: stage_worker/grammar.py).

This is the one code path for a stage, whether it runs in a worker process on the mesh or in the
in-process engine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from moemesh.protocol import (TIMELINE_SPANS, BlockTables, PromptLogprobs, SampledToken, Schedule, SeqWork, StepResult,
                              StepSpan)
from moemesh.sampling import SamplingParams
from stage_worker.grammar import Grammars, GrammarState
from stage_worker.runner import StageRunner, StepInput
from stage_worker.sampler import (SampleRow, TokenEdits, greedy_tokens, sample, token_logprobs, token_ranks,
                                  verify_sampled)


@dataclass
class SeqState:
    params: SamplingParams
    prompt_len: int
    tokens: list[int]  # every token fed so far, from position 0
    prompt_ids: list[int] | None  # the whole prompt, when prompt logprobs are wanted
    grammar: GrammarState | None = None  # a structured output's matcher (made at its first sample)
    edits: TokenEdits | None = None  # its allowed_token_ids, logit_bias and bad_words, made at its first sample


class StageExecutor:
    def __init__(self, runner: StageRunner, eos_token_ids: tuple[int, ...] = (),
                 generator: torch.Generator | None = None):
        self.runner = runner
        self.is_last = runner.model.has_head
        self.eos_token_ids = eos_token_ids
        if generator is None and self.is_last:  # for requests without a seed: different in every process
            generator = torch.Generator(device=runner.device)
            generator.seed()
        self.generator = generator
        self.seqs: dict[int, SeqState] = {}  # (last stage)
        self.grammars = Grammars(runner.model_dir, runner.config.vocab_size, eos_token_ids) if self.is_last else None
        self.block_tables = BlockTables()
        self.busy_seconds = 0.0
        # each step run, newest last (the worker's heartbeats take them; only the newest are kept)
        self.spans: deque[StepSpan] = deque(maxlen=TIMELINE_SPANS)

    def reset(self, first_step: int) -> None:
        """A new epoch from `first_step` on: every sequence of it is admitted afresh by a step at or
        after that, so what was admitted before is stale (a sequence that ended in the lost epoch,
        whose forget never came). What a step of the new epoch already admitted stays: a worker
        that learns of the epoch late may have run some."""
        for seq_id in self.block_tables.drop_admitted_before(first_step):
            self.seqs.pop(seq_id, None)

    def run(self, sched: Schedule, stream: torch.Tensor | None = None):
        """The previous stage's residual stream (None on the first stage) -> this stage's for the next
        stage, or a StepResult on the last stage."""
        wall, start = time.time(), time.perf_counter()
        handed: list[int] = []  # the hand-offs this stage took part in (its span says so)
        try:
            step = self._input(sched)
            handoff_in, handoff_out = self._handoff(sched)
            layers = self.runner.model.layer_range
            handed = [layers.start - 1] * handoff_in + [layers.stop - 1] * handoff_out
            if not self.is_last:
                return self.runner.execute(step, stream, handoff_in=handoff_in, handoff_out=handoff_out)
            if sched.num_steps > 1:
                if sched.mlp_handoff:
                    raise ValueError(f"step {sched.step_id}: a schedule of several steps hands no MLP over")
                return self._steps(sched, step)
            return self._sample(sched, step, stream, handoff_in)
        finally:
            seconds = time.perf_counter() - start
            self.busy_seconds += seconds
            self.spans.append(StepSpan.of(sched, wall, seconds, handed))

    def _handoff(self, sched: Schedule) -> tuple[bool, bool]:
        """(whether the stream comes without the previous stage's last MLP, whether this stage's last
        layer stops before its MLP): the schedule's `mlp_handoff` names the layers whose MLP the next
        stage runs this step."""
        if not sched.mlp_handoff:
            return False, False
        layers = self.runner.model.layer_range
        return layers.start - 1 in sched.mlp_handoff, not self.is_last and layers.stop - 1 in sched.mlp_handoff

    def _input(self, sched: Schedule) -> StepInput:
        """The step's tokens, positions and block tables. A decode with draft tokens runs as one decode row
        per token, each at its own position over the same table: every row's K/V is written before any
        row attends (stage_worker/layers/attention.py, the fused kernels' decoder layer), so row j sees
        the tokens before it and itself, as a prefill chunk's causal mask lets it, and a step of decodes
        with drafts stays a decode step (the fused path's, not the op-by-op one of prefill chunks). The
        rows are the same, in the same order, either way."""
        tables = self._apply(sched)
        if not any(w.draft for w in sched.seqs):
            return StepInput([w.token_ids for w in sched.seqs], [w.context_len for w in sched.seqs], tables,
                             [w.sample for w in sched.seqs])
        tokens, contexts, rows_tables, sample = [], [], [], []
        for w, table in zip(sched.seqs, tables):
            if w.draft:
                tokens += [[t] for t in w.token_ids]
                contexts += range(w.context_len, w.context_len + len(w.token_ids))
                rows_tables += [table] * len(w.token_ids)
                sample += [True] * len(w.token_ids)
            else:
                tokens.append(w.token_ids)
                contexts.append(w.context_len)
                rows_tables.append(table)
                sample.append(w.sample)
        return StepInput(tokens, contexts, rows_tables, sample)

    def _apply(self, sched: Schedule) -> list[list[int]]:
        """Forgets the sequences that ended; the step's block tables, brought up to date."""
        for seq_id in sched.forget:
            self.seqs.pop(seq_id, None)
        return self.block_tables.apply(sched)

    def _sample(self, sched: Schedule, step: StepInput, stream, handoff_in: bool = False) -> StepResult:
        sample_rows, prompt_rows = [], []  # (row, seq) / (row, seq, position predicted)
        drafted: list[tuple[int, SeqWork]] = []  # (first of its 1 + draft rows, a decode with draft tokens)
        row = 0
        for w in sched.seqs:
            st = self._fed(sched, w)
            if st.prompt_ids is not None:  # row at position q predicts prompt token q + 1
                for q in range(w.context_len, min(w.context_len + len(w.token_ids), st.prompt_len - 1)):
                    prompt_rows.append((row + q - w.context_len, w.seq_id, q + 1))
            row += len(w.token_ids)
            if w.draft:
                if not (w.sample and w.draft == len(w.token_ids) - 1 and self._plain(st)):
                    raise ValueError(f"step {sched.step_id}: sequence {w.seq_id}'s {w.draft} draft tokens need a "
                                     f"decode of its last token and them that samples greedily or without a seed, "
                                     f"with no logit edited or reported")
                drafted.append((row - 1 - w.draft, w))
            elif w.sample:
                sample_rows.append((row - 1, w.seq_id))
        draft_rows = [r + i for r, w in drafted for i in range(w.draft + 1)]
        if not prompt_rows and self.runner.model.can_screen and all(
                self._plain_greedy(self.seqs[seq_id]) for _, seq_id in sample_rows) and all(
                self.seqs[w.seq_id].params.greedy for _, w in drafted):
            # the rows in the batch's order (a step of decodes, every row sampled, takes the fused head)
            rows = sorted([r for r, _ in sample_rows] + draft_rows)
            by_row = dict(zip(rows, self.runner.execute(step, stream, logit_rows=rows, greedy=True,
                                                        handoff_in=handoff_in).tolist()))
            sampled = [SampledToken(seq_id, by_row[r]) for r, seq_id in sample_rows]
            return StepResult(sched.step_id, sampled + self._verify(drafted, [by_row[r] for r in draft_rows]),
                              busy_seconds=self.busy_seconds)
        wanted = [r for r, _ in sample_rows] + [r for r, _, _ in prompt_rows] + draft_rows
        if draft_rows:  # (asked in the batch's order: a step of decodes, every row wanted, takes the fused head)
            order = sorted(range(len(wanted)), key=wanted.__getitem__)
            logits = self.runner.execute(step, stream, handoff_in=handoff_in, logit_rows=[wanted[i] for i in order])
            logits = logits[torch.tensor(order).argsort()]
        else:
            logits = self.runner.execute(step, stream, handoff_in=handoff_in, logit_rows=wanted)
        n, m = len(sample_rows), len(sample_rows) + len(prompt_rows)
        rows = [self._row(seq_id) for _, seq_id in sample_rows]
        tokens, logprobs = sample(logits[:n], rows, self.eos_token_ids, self.generator)
        sampled = [SampledToken(seq_id, t, lp, self._constraint_error(seq_id))
                   for (_, seq_id), t, lp in zip(sample_rows, tokens, logprobs)]
        if drafted:
            sampled += self._verify(drafted, logits[m:])
        return StepResult(sched.step_id, sampled, self._prompt_logprobs(logits[n:m], prompt_rows),
                          busy_seconds=self.busy_seconds)

    def _verify(self, drafted: list[tuple[int, SeqWork]], rows: list[int] | torch.Tensor) -> list[SampledToken]:
        """The tokens each drafted decode keeps, from its 1 + draft rows in order (their greedy tokens,
        or their logits [rows, V]): row i is what follows its input and the first i drafts. A greedy
        sequence keeps tokens while each agrees with the draft token after it, and the first that does
        not (or the one after the last draft) ends them; a sampled one keeps each draft token with the
        probability its row gives it (`verify_sampled`). (The sequence's tokens here keep the refused
        drafts until its next step, whose context length cuts them, as it cuts any tokens past it:
        `_fed`.)"""
        out, at = [], 0
        greedy = rows if isinstance(rows, list) else None
        if greedy is None and any(self.seqs[w.seq_id].params.greedy for _, w in drafted):
            greedy = greedy_tokens(rows).tolist()
        for _, w in drafted:
            n = w.draft + 1
            guesses = w.token_ids[len(w.token_ids) - w.draft:]
            params = self.seqs[w.seq_id].params
            if not params.greedy:
                kept = verify_sampled(rows[at:at + n], params, guesses, self.generator)
                out += [SampledToken(w.seq_id, t) for t in kept]
                at += n
                continue
            mine, at = greedy[at:at + n], at + n
            kept = 1
            while kept <= w.draft and mine[kept - 1] == guesses[kept - 1]:
                kept += 1
            out += [SampledToken(w.seq_id, t) for t in mine[:kept]]
        return out

    def _fed(self, sched: Schedule, w: SeqWork) -> SeqState:
        """The sequence's sampling state with this step's tokens fed (created on admission)."""
        if w.params is not None:  # admitted: the tokens before this chunk came from the prefix cache
            self.seqs[w.seq_id] = SeqState(w.params, w.prompt_len, list(w.cached_ids or []), w.prompt_ids)
        st = self.seqs.get(w.seq_id)
        if st is None:
            raise ValueError(f"step {sched.step_id}: sequence {w.seq_id} has no sampling state "
                             f"(its first chunk did not carry params)")
        if not 0 <= w.context_len <= len(st.tokens):
            raise ValueError(f"step {sched.step_id}: sequence {w.seq_id} starts at {w.context_len}, outside the "
                             f"{len(st.tokens)} of its tokens known here")
        del st.tokens[w.context_len:]
        st.tokens.extend(w.token_ids)
        return st

    def _steps(self, sched: Schedule, step: StepInput) -> StepResult:
        """A schedule of several decode steps (`Schedule.num_steps`, on a stage that holds the whole
        model): each sequence decodes its token, then the token it sampled, num_steps steps in all.
        When every sequence samples greedily with nothing to edit or report (`_plain_greedy`: no
        penalties, logit_bias, allowed_token_ids, bad_words or grammar, min_tokens met, no logprobs)
        and the stage runs the fused decode, the steps are one native call;
        otherwise they run one by one through `_sample`, as separate schedules would."""
        k, n = sched.num_steps, len(sched.seqs)
        if not self.runner.model.has_embedding:
            raise ValueError(f"step {sched.step_id}: {k} decode steps in one schedule need a stage that holds "
                             f"the whole model")
        if any(len(w.token_ids) != 1 or not w.sample for w in sched.seqs):
            raise ValueError(f"step {sched.step_id}: a schedule of {k} steps holds decodes only")
        fused = self.runner.fused
        if fused is not None and fused.can_greedy and all(w.params is None for w in sched.seqs):
            states = [self._fed(sched, w) for w in sched.seqs]
            if all(self._plain_greedy(st) for st in states):
                out = fused.greedy([w.token_ids[0] for w in sched.seqs], [w.context_len for w in sched.seqs],
                                   step.block_tables, k, self.runner.block_size, self.runner.limits)
                for row in out[:-1]:  # fed back in: the sequences' tokens up to the last step's input
                    for st, t in zip(states, row):
                        st.tokens.append(t)
                return StepResult(sched.step_id, [SampledToken(w.seq_id, t) for row in out
                                                  for w, t in zip(sched.seqs, row)], busy_seconds=self.busy_seconds)
        result = self._sample(sched, step, None)
        sampled = list(result.sampled)
        for j in range(1, k):
            sub = [SeqWork(w.seq_id, [s.token_id], w.context_len + j, [], True) for w, s in zip(sched.seqs, result.sampled)]
            result = self._sample(Schedule(sched.step_id, sub),
                                  StepInput([w.token_ids for w in sub], [w.context_len for w in sub], step.block_tables,
                                            [True] * n), None)
            sampled += result.sampled
        return StepResult(sched.step_id, sampled, busy_seconds=self.busy_seconds)

    @staticmethod
    def _plain(st: SeqState) -> bool:
        """What a decode with draft tokens needs (the coordinator's `Scheduler._draft` asks the same): the
        sequence samples greedily, or without a seed (a seeded one draws by token index, which drafts
        would change), with no logit edited or reported and min_tokens met."""
        p = st.params
        return ((p.greedy or p.seed is None) and not p.edits_logits and p.logprobs is None and p.grammar is None
                and len(st.tokens) - st.prompt_len >= p.min_tokens)

    @staticmethod
    def _plain_greedy(st: SeqState) -> bool:
        """The sequence's next token is its logits' first maximum, with no logit edited (penalties,
        logit_bias, allowed_token_ids, bad_words, min_tokens' bans, a structured output's mask) or
        reported (logprobs)."""
        return (st.params.greedy and not st.params.edits_logits and st.params.logprobs is None
                and st.params.grammar is None and len(st.tokens) - st.prompt_len >= st.params.min_tokens)

    def _row(self, seq_id: int) -> SampleRow:
        st = self.seqs[seq_id]
        # the prompt is copied out only for the repetition penalty (the one user of it)
        prompt = st.tokens[:st.prompt_len] if st.params.repetition_penalty != 1 else []
        outputs = st.tokens[st.prompt_len:]
        allowed = None
        if st.params.grammar is not None:
            st.grammar, allowed = self.grammars.allowed(st.grammar, st.params.grammar, outputs, seq_id)
        if st.edits is None and st.params.edits_logits:
            st.edits = TokenEdits.of(st.params, self.runner.config.vocab_size)
        return SampleRow(st.params, prompt, outputs, allowed, st.edits)

    def _constraint_error(self, seq_id: int) -> str | None:
        """Why the sequence's structured output failed (its token the end of sequence that forced), or None."""
        grammar = self.seqs[seq_id].grammar
        return grammar.error if grammar is not None else None

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows) -> list[PromptLogprobs]:
        if not prompt_rows:
            return []
        lp = torch.log_softmax(logits, dim=-1)
        tokens = [self.seqs[seq_id].prompt_ids[pos] for _, seq_id, pos in prompt_rows]
        ranks = token_ranks(lp, tokens)
        out: dict[int, PromptLogprobs] = {}
        for i, (_, seq_id, pos) in enumerate(prompt_rows):
            st = self.seqs[seq_id]
            entry = token_logprobs(lp[i], tokens[i], st.params.prompt_logprobs, ranks[i])
            if seq_id not in out:
                out[seq_id] = PromptLogprobs(seq_id, pos, [])
            out[seq_id].logprobs.append(entry)
        return list(out.values())
