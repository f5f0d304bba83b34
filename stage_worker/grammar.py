"""Structured outputs on the last stage: each constrained sequence's llguidance matcher, kept in step
with the tokens the sequence has generated, and the mask of the tokens it may sample next.

A matcher follows the sequence's output tokens as the executor knows them (`SeqState.tokens` after
the prompt), not its own history: before each mask it is rolled back to where the two agree and fed
the rest. So a sequence recomputed after preemption, re-run after a recovery, or admitted afresh on
a worker that replaced a lost one (prompt and outputs as one prefill) gets the same masks as one
that never stopped.

A constraint that cannot be applied here ends the sequence: its mask allows only the end of sequence,
the reason is logged once per sequence, and the step's result says it (`SampledToken.error`), so that
the request ends with an error, not as an answer. The gateway validates every grammar before it is
queued, so this is a worker set up without the model's tokenizer (no tokenizer.json in the model
directory), or a constraint llguidance accepts but cannot follow to the end (a pattern whose lexer
grows past llguidance's limits part way through the answer, a token it rejects).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import numpy as np
import torch

from moemesh import structured

log = logging.getLogger("moemesh.stage_worker")


@dataclass
class GrammarState:
    """One sequence's matcher and the output tokens it has consumed (None: the constraint failed)."""
    matcher: object | None
    consumed: list[int] = field(default_factory=list)
    error: str | None = None  # why the constraint failed (each sample after it says so)


class Grammars:
    """The model's tokenizer as llguidance reads it (read when the stage is built), and the masks of
    constrained sequences. vocab_size: the width of the logits (tokens past the tokenizer's vocabulary are never
    allowed); eos_token_ids: what ends a sequence once its constraint is complete."""

    def __init__(self, model_dir: str | Path | None, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        # read now, not in the pipeline's way at the first constrained request (a large vocabulary takes
        # ~1 s); a model without one ends its constrained requests, each saying why
        self._tokenizer, self._tokenizer_error = None, None
        try:
            self._tokenizer = structured.tokenizer(model_dir or ".", vocab_size, self.eos_token_ids)
        except ValueError as e:
            self._tokenizer_error = str(e)

    def tokenizer(self):
        """llguidance's tokenizer of the model's tokenizer.json; raises RuntimeError where there is none."""
        if self._tokenizer is None:
            raise RuntimeError(f"structured output needs the model's tokenizer: {self._tokenizer_error}")
        return self._tokenizer

    def allowed(self, state: GrammarState | None, grammar: str, outputs: list[int], seq_id: int) \
            -> tuple[GrammarState, torch.Tensor]:
        """The sequence's state brought up to `outputs` (its generated tokens so far), and the tokens it
        may sample next: a [vocab_size] bool mask."""
        if state is None:
            state = self._start(grammar, seq_id)
        if state.matcher is not None:
            self._follow(state, grammar, outputs, seq_id)
        if state.matcher is None:
            return state, self._end_only()
        packed = np.frombuffer(state.matcher.compute_bitmask(), dtype=np.uint8)  # (32 tokens a word, low bit first)
        # (a matcher that errs part way allows only the end of sequence, or nothing: either is a failure, not
        # an answer whose text is whole)
        if state.matcher.is_error():
            self._fail(state, seq_id, state.matcher.get_error() or "the matcher failed")
            return state, self._end_only()
        bits = torch.from_numpy(np.unpackbits(packed, count=self.vocab_size, bitorder="little").view(np.bool_))
        if not bits.any():  # (end the sequence rather than sample noise)
            self._fail(state, seq_id, "no token allowed")
            return state, self._end_only()
        return state, bits

    def _start(self, grammar: str, seq_id: int) -> GrammarState:
        state = GrammarState(None)
        try:
            state.matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        except Exception as e:
            self._fail(state, seq_id, str(e))
            return state
        if state.matcher.is_error():
            self._fail(state, seq_id, state.matcher.get_error())
        return state

    def _follow(self, state: GrammarState, grammar: str, outputs: list[int], seq_id: int) -> None:
        """Rolls the matcher back to the longest prefix it shares with `outputs`, then feeds the rest."""
        common = len(state.consumed)
        if outputs[:common] != state.consumed:  # (not the usual one token more: find where they part)
            common = 0
            for a, b in zip(state.consumed, outputs):
                if a != b:
                    break
                common += 1
        if common < len(state.consumed):
            if not state.matcher.rollback(len(state.consumed) - common):
                fresh = self._start(grammar, seq_id)
                state.matcher, state.error, common = fresh.matcher, fresh.error, 0
                if state.matcher is None:
                    return
            del state.consumed[common:]
        for t in outputs[common:]:
            if not state.matcher.consume_token(t):
                self._fail(state, seq_id, state.matcher.get_error() or f"token {t} is outside the grammar")
                return
            state.consumed.append(t)

    def _fail(self, state: GrammarState, seq_id: int, reason: str) -> None:
        reason = reason.strip().splitlines()[0][:300] if reason.strip() else "unknown"
        log.warning("structured output ends a sequence: its constraint cannot be applied",
                    extra={"fields": {"seq_id": seq_id, "reason": reason}})
        state.matcher, state.error = None, reason

    def _end_only(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[[t for t in self.eos_token_ids if 0 <= t < self.vocab_size][:1] or [0]] = True
        return mask
