"""Beam search (vLLM's `use_beam_search`), run by the gateway over the engine's one-token steps.

Each step asks the engine for one token of every running beam, with the top alternatives' logprobs
(the model's own distribution, log-softmax of its logits). The prefix cache keeps the beams' shared
tokens, so a step recomputes only each beam's tail. That is how vLLM runs beam search too; the
engine and the pipeline know nothing of beams.

The search itself is transformers' `generate(num_beams=...)` (its current beam search), so that a
tiny checkpoint's beams can be checked against it token for token:
- each step keeps the best `candidates` continuations of all running beams by summed logprob
  (2 x width, or (1 + stop tokens) x width, so that `width` of them can always go on);
- a continuation that ends (a stop token, or max_tokens reached) among the best `width` is a finished
  hypothesis, scored by its summed logprob / (generated tokens ** length_penalty); the best `width`
  finished are kept;
- the best `width` that did not end run on;
- the search stops when no running beam can beat the worst kept hypothesis (early_stopping false:
  judged at the current length; "never": at max_tokens where length_penalty > 0), when `width` are
  finished (early_stopping true), or when every continuation ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moemesh.protocol import TokenLogprobs


@dataclass(frozen=True)
class BeamSettings:
    width: int
    max_tokens: int
    stops: frozenset[int]  # tokens that end a beam: the EOS ids (unless ignore_eos) and stop_token_ids
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    min_tokens: int = 0  # no stop token before this many tokens
    logprobs: int | None = None  # top alternatives to report per token (the request's logprobs)

    @property
    def candidates(self) -> int:
        """Continuations kept per step: enough that `width` go on whatever number of them ended."""
        return max(2, 1 + len(self.stops)) * self.width

    @property
    def top_n(self) -> int:
        """Alternatives to ask of the engine per beam and step: the candidates (every one may come from
        the same beam), the stop tokens a min_tokens rule strikes out, and what the request reports."""
        need = self.candidates + (len(self.stops) if self.min_tokens else 0)
        return max(need, self.logprobs or 0)


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    logprob: float = 0.0  # summed over the tokens
    score: float = 0.0  # a finished hypothesis': logprob / len(tokens) ** length_penalty
    stopped: bool = False  # ended by a stop token (else by max_tokens)


class BeamSearch:
    def __init__(self, settings: BeamSettings):
        self.s = settings
        self.running = [Beam()]
        self.finished: list[Beam] = []  # the best `width` hypotheses, best first
        self.improvable = True
        self.done = False

    def advance(self, steps: list[TokenLogprobs]) -> None:
        """steps[b]: the next token's logprobs for running beam b, with at least `top_n` alternatives
        (fewer where the vocabulary is smaller), best first."""
        s = self.s
        assert not self.done and len(steps) == len(self.running)
        length = len(self.running[0].tokens) + 1
        early = length <= s.min_tokens  # (a stop token is no candidate yet)
        found = []
        for b, (beam, step) in enumerate(zip(self.running, steps)):
            for rank, (token, logprob) in enumerate(step.top, 1):
                if early and token in s.stops:
                    continue
                found.append((beam.logprob + logprob, b, rank, token, logprob))
        found.sort(key=lambda c: (-c[0], c[1], c[2]))  # (ties: the earlier beam, then the likelier token)
        found = found[:s.candidates]
        last = length >= s.max_tokens
        ends = [last or c[3] in s.stops for c in found]

        def extended(c) -> Beam:
            total, b, rank, token, logprob = c
            parent, step = self.running[b], steps[b]
            top = step.top[:s.logprobs] if s.logprobs else []
            return Beam(parent.tokens + [token], parent.logprobs + [TokenLogprobs(token, logprob, top, rank)], total)

        full = len(self.finished) == s.width and s.early_stopping is True
        if self.improvable and not full:
            new = []
            for c, ended in zip(found[:s.width], ends):
                if ended:
                    beam = extended(c)
                    beam.score = beam.logprob / length ** s.length_penalty
                    beam.stopped = c[3] in s.stops
                    new.append(beam)
            # (stable: of equal scores the one kept earlier stays first)
            self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:s.width]
        self.running = [extended(c) for c, ended in zip(found, ends) if not ended][:s.width]
        if self.running and len(self.finished) == s.width:  # can a running beam still do better?
            best_length = s.max_tokens if s.early_stopping == "never" and s.length_penalty > 0 else length
            best = self.running[0].logprob / best_length ** s.length_penalty
            self.improvable = self.improvable and best > self.finished[-1].score
        all_finished = len(self.finished) == s.width and s.early_stopping is True
        self.done = not self.running or not self.improvable or all_finished or all(ends)

    def best(self, n: int) -> list[Beam]:
        """The n best hypotheses. Where fewer than n finished (a vocabulary smaller than the beams), the
        running ones fill in, scored the same way."""
        out = list(self.finished)
        for beam in self.running:
            if len(out) >= n:
                break
            if beam.tokens:
                beam.score = beam.logprob / len(beam.tokens) ** self.s.length_penalty
                out.append(beam)
        return sorted(out, key=lambda h: -h.score)[:n]
