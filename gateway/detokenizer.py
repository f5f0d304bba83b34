"""Streaming text from streaming tokens: never a broken UTF-8 character, stop strings found across
token boundaries and left out, and the pieces add up to the full decode."""

from __future__ import annotations

from moemesh.tokenizer import TextTokenizer


# prompt tokens the first window starts with (vLLM's choice too): enough for a decoder's context
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes a growing token list window by window: text is released once the window's decode no
    longer ends in an incomplete character (U+FFFD where the bytes end inside a character).

    `context`: the prompt. Its last tokens open the first window, so the first generated token
    decodes as it does after the prompt: a SentencePiece-style decoder (Llama, Mistral, Mixtral)
    strips the leading space of whatever a decode starts with, and " Paris" after "The capital of
    France is" would otherwise come out as "Paris"."""

    def __init__(self, tokenizer: TextTokenizer, stop: list[str] = (), min_tokens: int = 0,
                 context: list[int] = (), include_stop: bool = False, skip_special_tokens: bool = True):
        """`include_stop`: the text ends after the stop string found, not before it (vLLM's
        include_stop_str_in_output); `skip_special_tokens`: special tokens are not text."""
        self.tok = tokenizer
        self.include_stop, self.skip_special = include_stop, skip_special_tokens
        prompt = list(context)
        start = max(0, len(prompt) - CONTEXT_TOKENS)
        for _ in range(3):  # the window starts at a character, not inside one (whose bytes span <= 4 tokens)
            if start == 0 or not self._decode(prompt[max(0, start - 8):start]).endswith("\ufffd"):
                break
            start -= 1
        self.tokens: list[int] = prompt[start:]
        self.context = len(self.tokens)  # (not generated: never text of this sequence's own)
        self.prefix_offset, self.read_offset = 0, self.context
        # a prompt that ends inside a character (a token-id prompt): the character the first generated
        # bytes complete is this sequence's text, whole; the first window's prefix is the context's
        # whole characters
        # (told by the bytes: a prompt that ends in a U+FFFD of its own does not end inside a character)
        inside = bool(self.tokens) and self.tok.ends_inside_character(self.tokens)
        self._first_prefix = len(self._decode(self.tokens).rstrip("\ufffd")) if inside else None
        self.text = ""  # decoded so far (stop string and what follows cut off)
        self.emitted = 0  # characters of self.text already returned
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens  # no stop string ends the text before this many tokens (as vLLM)
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one has

    @property
    def checking(self) -> bool:
        return len(self.tokens) - self.context >= self.min_tokens

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the new text that is safe to show (may be empty)."""
        if self.stopped:
            return ""
        self.tokens.extend(token_ids)
        prefix = self._prefix_chars()
        full = self._decode(self.tokens[self.prefix_offset:])
        # a U+FFFD at the end is held while it is a character's first bytes (the rest may come); an
        # invalid byte, or a U+FFFD of the text's own, stays what it is: held, every later token would
        # decode the growing window again (quadratic, on the event loop)
        if len(full) > prefix and (not full.endswith("\ufffd") or not self.tok.ends_inside_character(self.tokens)):
            start = len(self.text)
            self.text += full[prefix:]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self._check_stop(start)
        return self._release()

    def _prefix_chars(self) -> int:
        """Characters of the window's decode that are shown already (or the prompt's)."""
        if self._first_prefix is not None and self.read_offset == self.context:
            return self._first_prefix
        return len(self._decode(self.tokens[self.prefix_offset:self.read_offset]))

    def finish(self) -> str:
        """At the end of the request: whatever is still held back (a partial stop-string match)."""
        if not self.stopped:
            rest = self._decode(self.tokens[self.prefix_offset:])
            prefix = self._prefix_chars()
            if len(rest) > prefix:
                start = len(self.text)
                self.text += rest[prefix:]
                self._check_stop(start)
            self.prefix_offset = self.read_offset = len(self.tokens)  # a second finish() adds nothing
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out

    def _check_stop(self, start: int) -> None:
        if not self.checking:
            return
        longest = max((len(s) for s in self.stop), default=0)
        # (not before what was shown: text released before min_tokens stays shown)
        search_from = max(0, start - longest + 1, self.emitted)
        hits = [(i, i + len(s)) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            first, end = min(hits, key=lambda hit: (hit[0], -hit[1]))  # (the first; of those there, the longest)
            self.matched = self.text[first:end]
            self.text = self.text[:end if self.include_stop else first]
            self.stopped = True

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def _release(self) -> str:
        end = len(self.text)
        if not self.stopped:  # hold back a tail that may be the start of a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text) - self.emitted), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return out
