"""Reasoning outputs' pieces (gateway/reasoning.py): a thinking model's answer split into its thought
and the rest, finished or streamed, and a constraint applied after the thought
(moemesh/structured.py's after_thought). Through the gateway and the mesh: tests/test_gateway.py."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from gateway.reasoning import PARSERS, ReasoningMode, ReasoningStream, opens_thought, split
from moemesh import structured
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

SPLITS = [  # (parser, does the prompt open a thought, the answer's text) -> (reasoning, content)
    ("deepseek_r1", False, " <think>\nHmm</think>Yes", ("Hmm", "Yes")),  # (a space before its own tag)
    ("deepseek_r1", False, " <", (" <", None)),  # (a thought that is a part of the tag)
    ("deepseek_r1", False, "<think>", (None, None)),
    ("qwen3", True, "<think>\n", (None, None)),
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nParis.", ("Let me see.\n", "Paris.")),
    ("qwen3", False, "  \n<think>a</think>b", ("a", "b")),
    ("qwen3", False, "Paris.", (None, "Paris.")),  # (enable_thinking false: no thought)
    ("qwen3", False, "\n\nParis.", (None, "\n\nParis.")),
    ("qwen3", False, "<thin", (None, "<thin")),  # (a tag's start that never became one)
    ("qwen3", False, "A <think> in the answer", (None, "A <think> in the answer")),
    ("qwen3", False, "<think>\ncut short by max_tokens", ("cut short by max_tokens", None)),
    ("qwen3", False, "<think></think>\n\nx", (None, "x")),  # (an empty thought)
    ("qwen3", True, "\nHmm.\n</think>\n\nYes.", ("Hmm.\n", "Yes.")),  # (the prompt ends with <think>)
    ("qwen3", True, "<think>Hmm.</think>Yes.", ("Hmm.", "Yes.")),  # (and the model writes its own)
    ("qwen3", True, "no end", ("no end", None)),
    ("deepseek_r1", False, "Hmm.</think>Yes.", ("Hmm.", "Yes.")),  # (R1's template opens it)
    ("deepseek_r1", False, "<think>\nHmm.</think>\n\nYes.", ("Hmm.", "Yes.")),  # (R1-0528 writes it)
    ("deepseek_r1", False, "all thought", ("all thought", None)),  # (as vLLM's)
    ("deepseek_r1", False, "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", False, "a</thi", ("a</thi", None)),
    ("deepseek_r1", False, "\n\n", (None, None)),
    ("qwen3", False, "", (None, None)),
]


@pytest.mark.parametrize("parser, opened, text, want", SPLITS)
def test_an_answer_splits_into_thought_and_content_finished_or_streamed(parser, opened, text, want):
    mode = ReasoningMode.of(parser, opened)
    assert split(mode, text) == want
    for size in (1, 2, 3, 5):  # streamed in pieces: the pieces join to the same fields
        stream, thought, content = ReasoningStream(mode), "", ""
        for at in range(0, len(text), size):
            a, b = stream.add(text[at:at + size])
            thought, content = thought + a, content + b
        a, b = stream.finish()
        assert ((thought + a) or None, (content + b) or None) == want, size


def test_streamed_pieces_join_to_the_whole_answers_fields_for_any_text():
    """Texts made of tags, their parts, whitespace and letters, cut anywhere (400 seeded cases per parser)."""
    rng = random.Random(7)
    atoms = ["<think>", "</think>", "\n", " ", "a", "<", "</", "think", ">", "<thi", "nk>", "\n\n", "<think>"]
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        for parser, opened in (("qwen3", False), ("qwen3", True), ("deepseek_r1", False)):
            mode = ReasoningMode.of(parser, opened)
            stream, thought, content = ReasoningStream(mode), "", ""
            for piece in pieces:
                a, b = stream.add(piece)
                thought, content = thought + a, content + b
            a, b = stream.finish()
            assert ((thought + a) or None, (content + b) or None) == split(mode, text), (parser, opened, pieces)


def test_a_stream_holds_back_only_what_may_still_be_a_tag():
    stream = ReasoningStream(ReasoningMode.of("qwen3", False))
    assert stream.add("<th") == ("", "")  # (may open a thought)
    assert stream.add("ink>I") == ("I", "")
    assert stream.add(" think</") == (" think", "")  # (may close it)
    assert stream.add("b") == ("</b", "")  # (it did not)
    assert stream.add("</think>") == ("", "")
    assert stream.add("\n\n") == ("", "")  # (the blank line after the thought is not content)
    assert stream.add("Yes") == ("", "Yes")
    assert stream.add("</think>") == ("", "</think>")  # (the answer is content, whatever it says)
    plain = ReasoningStream(ReasoningMode.of("qwen3", False))
    assert plain.add("Hi") == ("", "Hi") and plain.add(" <think>") == ("", " <think>")


def test_a_prompt_opens_a_thought_where_its_last_tag_is_an_open_one():
    assert opens_thought("<|im_start|>assistant\n<think>\n")
    assert not opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # (enable_thinking false)
    assert not opens_thought("<|im_start|>assistant\n")
    assert ReasoningMode.of("deepseek_r1", False).thinking and not ReasoningMode.of("qwen3", False).thinking
    with pytest.raises(ValueError):
        ReasoningMode.of("nosuch", False)


def test_the_gateways_parsers_are_the_flags_choices():
    from moemesh.settings import GatewaySettings

    (flag,) = [f for f in GatewaySettings.flags() if f.name == "reasoning_parser"]
    assert set(flag.metadata["flag"].choices) == set(PARSERS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    spec = TinyModelSpec(arch="mixtral", num_layers=1, hidden_size=32, intermediate_size=32, num_experts=2,
                         vocab_size=600, max_position_embeddings=64)
    model = write_tiny_model(spec, tmp_path_factory.mktemp("reasoning") / "tiny")
    return structured.tokenizer(model, spec.vocab_size, (0,))


CONSTRAINTS = {
    "json": ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}, '{"a": 12}'),
    "regex": ({"guided_regex": "yes|no"}, "no"),
    "choice": ({"guided_choice": ["yes", "no"]}, "yes"),
    "grammar": ({"guided_grammar": 'start: "yes" | "no"'}, "yes"),
    "gbnf": ({"guided_grammar": 'root ::= "y" [0-9]'}, "y7"),
}
# pieces of an answer: text, or a tag (as text or, where the tokenizer makes them special, as a token)
THOUGHT, OPEN_ONLY, BAD_ANSWER = ["<think>", "Hmm, 12.", "</think>", "\n\n"], ["Hmm.", "</think>"], "maybe"


def _accepts(tokenizer, grammar: str, pieces: list, special: bool) -> bool:
    ids = []
    for piece in pieces:
        tag = {"<think>": 2, "</think>": 3}.get(piece) if special else None
        ids += [tag] if tag is not None else tokenizer.tokenize_str(piece)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("special", [False, True], ids=["tags-as-text", "tags-as-special-tokens"])
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_a_constraint_applies_after_a_free_thought(tokenizer, kind, special):
    """Where the prompt opens the thought, the answer must close it and then follow the constraint;
    where it does not, the answer may think first or answer at once. Either way nothing but the
    constraint is taken after the thought, and a thought holds anything but its end (and EOS)."""
    fields, answer = CONSTRAINTS[kind]
    grammar = structured.grammar_of(fields, tokenizer)
    tags = (2, 3) if special else None  # (this tokenizer's <|im_start|> and <|im_end|> stand for the tags)
    inside = structured.after_thought(grammar, True, tags, (0,))
    free = structured.after_thought(grammar, False, tags, (0,))
    for g in (inside, free):
        assert not llguidance.LLMatcher.validate_grammar_with_warnings(g, tokenizer)[0]
    assert _accepts(tokenizer, inside, [*THOUGHT[1:], answer], special)
    assert _accepts(tokenizer, inside, [*THOUGHT, answer], special)  # (a model that writes its own <think>)
    assert not _accepts(tokenizer, inside, [answer], special)  # (the thought is the prompt's: it must close)
    assert not _accepts(tokenizer, inside, [*THOUGHT[1:], BAD_ANSWER], special)
    assert _accepts(tokenizer, free, [*THOUGHT, answer], special)
    assert _accepts(tokenizer, free, [answer], special)
    assert not _accepts(tokenizer, free, [*OPEN_ONLY, answer], special)  # (a thought opens with <think>)
    assert not _accepts(tokenizer, free, [*THOUGHT, BAD_ANSWER], special)
    if special:  # EOS cannot end a thought
        matcher = llguidance.LLMatcher(tokenizer, inside, log_level=0)
        assert matcher.consume_token(tokenizer.tokenize_str("Hmm")[0]) and not matcher.consume_token(0)
