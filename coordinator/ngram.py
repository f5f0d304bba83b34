"""Draft tokens for speculative decoding by prompt lookup (n-gram matching), as vLLM's `ngram` method
and llama.cpp's lookup decoding propose them: where the sequence's last n tokens occurred before in
its prompt or output, the tokens that followed that occurrence are a guess at what comes next. The
last stage checks the guesses in one step (`StageExecutor`): a greedy sequence keeps every draft
token its own argmax agrees with, and the token after the last of them, so its output is the one it
would have had one token a step, in fewer steps where the text repeats itself (code edits, quoting,
structured answers).

Each sequence keeps an index of where every n-gram (n from `min_n` to `max_n`) last ended, grown by
the tokens appended since it last looked: a lookup costs O(max_n) dictionary probes, not a scan of
the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class NgramConfig:
    num_tokens: int  # draft tokens proposed at most per step (0: no speculation)
    min_n: int = 1  # the shortest suffix matched
    max_n: int = 4  # the longest, tried first
    max_batch: int | None = None  # no drafts while more sequences than this are running
    sampled: bool = False  # drafts for sequences that sample (without a seed) too, not only greedy ones


class Tokens(Protocol):
    """What the index reads of a sequence (coordinator.sequence.Sequence): its length and slices, so
    that a step costs what was appended since the last, not a copy of the context."""
    num_tokens: int

    def tokens(self, start: int, end: int) -> list[int]: ...


@dataclass
class NgramIndex:
    """Where each n-gram of a token list last ended (the position after its last token), for the
    n-grams that have a token after them. About 130 bytes per token and n-gram length (a tuple key and
    a dictionary entry): 1.6 MB for a context of 4,096 tokens with lengths 2 to 4, indexed in about 2 ms
    at its first lookup; then 6-7 us a step (measured in docs/benchmarks.md)."""
    min_n: int
    max_n: int
    indexed: int = 0  # end positions up to this one are in the maps
    ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)

    def __post_init__(self):
        self.ends = [{} for _ in range(self.max_n - self.min_n + 1)]

    def propose(self, seq: Tokens, k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix of the sequence's
        tokens (max_n down to min_n tokens long) seen before, those after it repeated where it ended
        fewer than k tokens back; [] where none was."""
        L = seq.num_tokens
        # every n-gram ending before the last position has a token after it: index those not yet indexed
        if L - 1 > self.indexed:
            start = max(0, self.indexed - self.max_n)
            new = seq.tokens(start, L - 1)  # (the tokens of the n-grams that end at indexed + 1 .. L - 1)
            for n, ends in zip(range(self.min_n, self.max_n + 1), self.ends):
                first = max(self.indexed + 1, n)  # the first end position not indexed for this n
                if first > L - 1:
                    continue
                # n-grams as tuples, at C speed; later ones overwrite earlier: the latest end stays
                grams = zip(*(new[first - n - start + i:] for i in range(n)))
                ends.update(zip(grams, range(first, L)))
            self.indexed = L - 1
        suffix = seq.tokens(max(0, L - self.max_n), L)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = self.ends[n - self.min_n].get(tuple(suffix[len(suffix) - n:]))
            if e is not None:
                after = seq.tokens(e, min(e + k, L))
                # (an occurrence fewer than k tokens back: the text repeats with that period, and so does
                # the draft, as far as k)
                return after if len(after) == k else [after[j % len(after)] for j in range(k)]
        return []
