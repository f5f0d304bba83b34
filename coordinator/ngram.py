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


@dataclass(frozen=True)
class NgramConfig:
    num_tokens: int  # draft tokens proposed at most per step (0: no speculation)
    min_n: int = 1  # the shortest suffix matched
    max_n: int = 4  # the longest, tried first
    max_batch: int | None = None  # no drafts while more sequences than this are running


@dataclass
class NgramIndex:
    """Where each n-gram of a token list last ended (the position after its last token), for the
    n-grams that have a token after them."""
    min_n: int
    max_n: int
    indexed: int = 0  # end positions below this are in the maps
    ends: list[dict[tuple[int, ...], int]] = field(default_factory=list)

    def __post_init__(self):
        self.ends = [{} for _ in range(self.max_n - self.min_n + 1)]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
        (max_n down to min_n tokens long) seen before; [] where none was."""
        L = len(tokens)
        # every n-gram ending before the last position has a token after it: index those not yet indexed
        for e in range(max(self.indexed, self.min_n), L):
            for n, ends in zip(range(self.min_n, self.max_n + 1), self.ends):
                if n > e:
                    break
                ends[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, L)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = self.ends[n - self.min_n].get(tuple(tokens[L - n:]))
            if e is not None:
                return tokens[e:e + k]
        return []
