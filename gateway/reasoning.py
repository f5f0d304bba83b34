"""Reasoning outputs in /v1/chat/completions, as vLLM's `--reasoning-parser` gives them: a thinking
model's thought (`<think>` ... `</think>`) comes back apart from its answer, in the message's
`reasoning` (vLLM's name since 0.11) and `reasoning_content` (DeepSeek's API, and vLLM's before), and
streams in deltas of the same two fields. The answer after the thought is the message's content, which
a --tool-call-parser reads for calls.

Where a thought is, by the parser (gateway's `--reasoning-parser`):
- qwen3: an answer that opens with `<think>` (after whitespace) thinks until `</think>`; one that does
  not is all content (Qwen3 with enable_thinking false, whose template writes an empty thought into
  the prompt);
- deepseek_r1: the answer is a thought until `</think>` whether or not it opens with `<think>` (R1's
  templates open it in the prompt), and an answer that never closes it is all thought (as vLLM's).
For both, a prompt that itself ends inside an open thought (a template that writes `<think>` after the
generation prompt, as Qwen3's thinking-2507 models' do, or a continued final message whose thought is
open) starts the answer inside it.

Both fields drop the newlines that open them (a template's `<think>\\n`, and the blank line after
`</think>`), so a streamed answer's pieces join to the whole answer's fields. A thought cut short by
max_tokens is reasoning with no content. The work is on text: the tags must show in the answer's text,
which they do where they are ordinary tokens (Qwen3's and DeepSeek-R1's tokenizers), and the gateway
keeps special tokens in the text of a model whose tokenizer makes them special.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.tools import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningMode:
    """How one chat answer is split. thinking: it starts inside a thought; shown: its reasoning is sent
    (vLLM's include_reasoning)."""
    thinking: bool
    shown: bool = True

    @classmethod
    def of(cls, parser: str, prompt_opens: bool, shown: bool = True) -> ReasoningMode:
        """The mode of an answer by `parser` to a prompt that ends inside a thought or not."""
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        return cls(parser == "deepseek_r1" or prompt_opens, shown)


def opens_thought(text: str) -> bool:
    """Whether text ends inside a thought: a `<think>` with no `</think>` after it."""
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


class ReasoningStream:
    """One choice's text as it comes, split into (reasoning, content) pieces. A tail that may be the
    start of a tag it waits for is held back until the next piece tells."""

    def __init__(self, mode: ReasoningMode):
        self.mode = mode
        # "start": may open a thought; "thought"; "answer". opening: a thought's start not yet past
        # its newlines; tagged: past where its `<think>` may be; fresh: an answer after a thought, its
        # newlines not yet past
        self.state = "thought" if mode.thinking else "start"
        self.opening, self.tagged, self.fresh = True, False, False
        self.held = ""

    def add(self, piece: str) -> tuple[str, str]:
        """The (reasoning, content) that `piece` makes sendable."""
        text, self.held = self.held + piece, ""
        reasoning, content = "", ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.state, self.tagged, text = "thought", True, stripped[len(THINK_OPEN):]
                    continue
                if THINK_OPEN.startswith(stripped):  # (whitespace, or a part of the tag: not known yet)
                    self.held = text
                    return reasoning, content
                self.state = "answer"
                continue
            if self.state == "thought":
                if self.opening:
                    if not self.tagged:  # a thought opened in the prompt may still write its own tag first
                        stripped = text.lstrip()
                        if stripped != THINK_OPEN and THINK_OPEN.startswith(stripped):
                            self.held = text  # (whitespace, or a part of the tag: not known yet)
                            return reasoning, content
                        self.tagged = True
                        if stripped.startswith(THINK_OPEN):
                            text = stripped[len(THINK_OPEN):]
                    text = text.lstrip("\n")
                    if not text:
                        return reasoning, content
                    self.opening = False
                end = text.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += text[:end]
                    self.state, self.fresh, text = "answer", True, text[end + len(THINK_CLOSE):]
                    continue
                keep = partial_suffix(text, THINK_CLOSE)
                reasoning += text[:len(text) - keep]
                self.held = text[len(text) - keep:]
                return reasoning, content
            if self.fresh:
                text = text.lstrip("\n")
                if not text:
                    return reasoning, content
                self.fresh = False
            content += text
            text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """At the choice's end: what is still held, as (reasoning, content)."""
        text, self.held = self.held, ""
        if self.state == "thought":
            if self.opening:  # (only whitespace came, perhaps with a part of `<think>`: that is the thought)
                return (text.lstrip("\n") if text.strip() else ""), ""
            return text, ""
        return "", text


def split(mode: ReasoningMode, text: str) -> tuple[str | None, str | None]:
    """A finished answer's (reasoning, content), None where empty: what its stream would have sent."""
    stream = ReasoningStream(mode)
    reasoning, content = stream.add(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None

