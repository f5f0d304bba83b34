"""Tool calling's pieces (gateway/tools.py): the tool_choice a request gives, the constraint it
becomes, and the calls read from a finished or streamed answer. Through the gateway and the mesh:
tests/test_gateway.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import llguidance
import pytest

from gateway.tools import PARSERS, ToolError, ToolMode, ToolStream, functions, read_calls, template_messages, tool_mode
from moemesh.structured import grammar_of

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MODEL_DIR = Path(__file__).resolve().parents[1] / "moemesh" / "demo_model"


def test_tool_choice_decides_the_constraint_or_is_a_clear_error():
    tools = functions([WEATHER, TIME])
    assert tool_mode(None, None, None, None) == (None, None)
    assert tool_mode(tools, "none", None, None) == (None, None)
    mode, fields = tool_mode(tools, {"type": "function", "function": {"name": "get_weather"}}, None, None)
    schema = WEATHER["function"]["parameters"]
    assert mode == ToolMode("named", name="get_weather")
    assert fields == {"guided_json": {**schema, "x-guidance": {"whitespace_pattern": "[ ]?"}}}
    own = {**schema, "x-guidance": {"whitespace_flexible": False}}  # (a schema's own say wins)
    assert tool_mode(functions([{"type": "function", "function": {"name": "f", "parameters": own}}]),
                     {"type": "function", "function": {"name": "f"}}, None, None)[1] == {"guided_json": own}
    mode, fields = tool_mode(tools, "required", False, None)
    assert mode.kind == "required" and fields["guided_json"]["maxItems"] == 1
    assert grammar_of(fields)  # (a schema llguidance takes)
    assert tool_mode(tools, None, None, "hermes") == (ToolMode("auto", parser="hermes"), None)
    errors = [  # (tools, tool_choice, parser) -> the field named
        (([WEATHER], None, None), "tool_choice"),  # auto without a parser
        (([WEATHER], {"type": "function", "function": {"name": "nope"}}, None), "tool_choice"),
        ((None, "required", None), "tool_choice"),
        (([WEATHER], "sometimes", None), "tool_choice"),
        (([WEATHER], {"type": "function", "function": "get_weather"}, None), "tool_choice"),
        (([WEATHER], {"function": {"name": ["get_weather"]}}, None), "tool_choice"),
        (([WEATHER], {"function": {"name": {"a": 1}}}, None), "tool_choice"),
    ]
    deep: object = {"type": "object"}
    for _ in range(300):  # parameters nested as deep as a request's JSON may go: a 400, not a RecursionError
        deep = {"type": "object", "x": [[deep]]}
    errors.append((([{"type": "function", "function": {"name": "f", "parameters": deep}}], "required", None), "tools"))
    for (given, choice, parser), param in errors:
        with pytest.raises(ToolError) as e:
            tool_mode(functions(given) if given else None, choice, None, parser)
        assert e.value.param == param, (given, choice)
    for bad in ([{"type": "function"}], [{"type": "retrieval", "function": {"name": "x"}}], "x",
                [{"function": {"name": "f", "parameters": "no"}}]):
        with pytest.raises(ToolError):
            functions(bad)


def test_required_keeps_each_functions_references_pointing_inside_it():
    """Under "required" each function's parameters are a subschema of the array of calls: their local
    references ("#": a recursive schema; "#/$defs/X"; "#/properties/a") still point inside them, and two
    functions may define the same name differently."""
    from moemesh.structured import tokenizer

    location = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {
        "$ref": "#"}, "maxItems": 2}}, "required": ["v", "kids"], "additionalProperties": False}
    sibling = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
               "required": ["a", "b"], "additionalProperties": False, "$defs": {"Loc": {"type": "integer"}}}
    tools = functions([{"type": "function", "function": {"name": "where", "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/$defs/Loc"}, "enum": {"enum": [{"$ref": "#"}]}},
        "required": ["where"], "$defs": {"Loc": location}}}},
        {"type": "function", "function": {"name": "tree", "parameters": tree}},
        {"type": "function", "function": {"name": "sibling", "parameters": sibling}}])
    _, fields = tool_mode(tools, "required", None, None)
    schema = fields["guided_json"]
    assert schema["$defs"]["call0"]["properties"]["where"] == {"$ref": "#/$defs/call0/$defs/Loc"}
    assert schema["$defs"]["call0"]["properties"]["enum"] == {"enum": [{"$ref": "#"}]}  # (data, not a reference)
    assert schema["$defs"]["call1"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/call1"}
    tok = tokenizer(MODEL_DIR, 4096, (0,))
    grammar = grammar_of(fields, tok)

    def accepts(calls) -> bool:
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        return matcher.consume_tokens(tok.tokenize_str(json.dumps(calls))) and matcher.is_accepting()

    assert accepts([{"name": "tree", "parameters": {"v": 1, "kids": [{"v": 2, "kids": []}]}}])
    assert not accepts([{"name": "tree", "parameters": {"v": 1, "kids": [[{"name": "tree", "parameters": {
        "v": 2, "kids": []}}]]}}])
    assert accepts([{"name": "sibling", "parameters": {"a": 1, "b": 2}}])
    assert accepts([{"name": "where", "parameters": {"where": {"city": "Oslo"}}}])
    assert not accepts([{"name": "where", "parameters": {"where": 5}}])
    # a schema with its own $id is a resource whose references are its own; an anchor names a place
    own = {"$id": "https://example.com/p.json", "type": "object", "properties": {"a": {"$ref": "#/$defs/N"}},
           "required": ["a"], "$defs": {"N": {"type": "integer"}}}
    anchored = {"type": "object", "properties": {"a": {"$ref": "#num"}}, "required": ["a"],
                "$defs": {"N": {"$anchor": "num", "type": "integer"}}}
    for parameters in (own, anchored):
        tools = functions([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
        _, fields = tool_mode(tools, "required", None, None)
        assert fields["guided_json"]["$defs"]["call0"] == parameters
        grammar = grammar_of(fields, tok)
        assert accepts([{"name": "f", "parameters": {"a": 1}}])
        assert not accepts([{"name": "f", "parameters": {"a": "x"}}])


def test_calls_read_from_answers():
    content, calls = read_calls(ToolMode("named", name="f"), '{"a": 1}')
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    content, calls = read_calls(ToolMode("required"), '[{"name": "f", "parameters": {"a": "é"}}, {"name": "g", '
                                                      '"parameters": {}}]')
    assert content is None and [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": "é"}'},
                                                                   {"name": "g", "arguments": "{}"}]
    # cut short (max_tokens): the calls begun, the last with what it had (as a named call cut short), and
    # never the constraint's JSON as content
    assert read_calls(ToolMode("required"), '[{"name": "f", "param') == (None, [])
    content, calls = read_calls(ToolMode("required"), '[{"name" : "f", "parameters" : {"a" : [1]}} , '
                                                      '{"name" : "g\\"", "parameters" : {"b" : 30,')
    assert content is None and [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": [1]}'},
                                                                   {"name": 'g"', "arguments": '{"b" : 30,'}]
    cut = ToolStream(ToolMode("required"))
    assert cut.content('[{"name": "f", "param') == "" and cut.finish() == ("", [])
    deep = '[{"name": "f", "parameters": {"a": ' + "[" * 5000
    assert [c["function"]["name"] for c in read_calls(ToolMode("required"), deep)[1]] == ["f"]
    auto = ToolMode("auto", parser="hermes")
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = read_calls(auto, text)
    assert content == "Let me look.\n" and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert [c["function"]["name"] for c in read_calls(ToolMode("auto", parser="hermes", parallel=False), text)[1]] \
        == ["f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 2} and calls[0]["id"] != calls[1]["id"]
    assert read_calls(auto, "no calls here") == ("no calls here", [])
    assert read_calls(auto, "<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    _, calls = read_calls(auto, '<tool_call>{"name": "f", "arguments": {"x": 1}}')  # (unclosed at the end)
    assert [c["function"]["name"] for c in calls] == ["f"]


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_streamed_answer_sends_content_until_a_call_begins(cut):
    text = 'Sure <b>.\n<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>'
    stream = ToolStream(ToolMode("auto", parser="hermes"))
    sent = "".join(stream.content(text[i:i + cut]) for i in range(0, len(text), cut))
    rest, calls = stream.finish()
    assert sent + rest == "Sure <b>.\n" and [c["function"]["name"] for c in calls] == ["f"]
    plain = ToolStream(ToolMode("auto", parser="hermes"))
    sent = "".join(plain.content(p) for p in ["a <tool", "_c", "x> b"])
    assert sent + plain.finish()[0] == "a <tool_cx> b" and plain.finish()[1] == []
    held = ToolStream(ToolMode("required"))
    assert held.content('[{"name": "f", "parameters": {}}]') == "" and len(held.finish()[1]) == 1


# each parser: (answer text, its content, its calls as (name, arguments)) for a finished answer
WRITTEN = {
    "mistral": [
        ('Checking. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 2}}, {"name": "g", "arguments": {}}]',
         "Checking. ", [("f", {"x": 2}), ("g", {})]),
        ('[TOOL_CALLS]f[ARGS]{"x": 2}[TOOL_CALLS]g{}', None, [("f", {"x": 2}), ("g", {})]),  # (v11 tokenizers)
        ('[TOOL_CALLS] {"name": "f", "arguments": {"x": 2}}', None, [("f", {"x": 2})]),
        ("no calls [TOOL_CALLS] [{not json", "no calls [TOOL_CALLS] [{not json", []),
        ("[TOOL_CALLS]f", "[TOOL_CALLS]f", []),
    ],
    "llama3_json": [
        ('{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}', None, [("f", {"x": 2}), ("g", {})]),
        (' <|python_tag|>{"name": "f", "arguments": {"x": "é"}}', None, [("f", {"x": "é"})]),
        ('The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
        ('{"name": "f", "parameters": {}} and more', '{"name": "f", "parameters": {}} and more', []),
        ('{"no": "name"}', '{"no": "name"}', []),
        ('{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),  # (a JSON answer, not a call)
        ('{"name": "f", "parameters": {"x": NaN}}', '{"name": "f", "parameters": {"x": NaN}}', []),  # (not JSON)
    ],
    "qwen3_coder": [  # (no schema here: a value that is JSON is read as JSON, the rest as text)
        ("Let me check.\n<tool_call>\n<function=f>\n<parameter=x>\n2\n</parameter>\n<parameter=city>\nSan Jose\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call>",
         "Let me check.\n", [("f", {"x": 2, "city": "San Jose"}), ("g", {})]),
        ("<tool_call>\n<function=f>\n<parameter=q>\n{\"a\": [1, null]}\n</parameter>\n</function>",  # (cut short)
         None, [("f", {"q": {"a": [1, None]}})]),
        ("<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>", "<tool_call>\n<parameter=x>\n1\n"
         "</parameter>\n</tool_call>", []),  # (no function: not a call)
    ],
    "pythonic": [
        ('[f(x=2, y="a"), g(z=[1, {"k": None}])]', None, [("f", {"x": 2, "y": "a"}), ("g", {"z": [1, {"k": None}]})]),
        ("<|python_start|>[f()]<|python_end|>", None, [("f", {})]),
        ("[f(2)]", "[f(2)]", []),  # (positional: not a call this format writes)
        ("[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),  # (literals only: nothing is run)
        ("[1, 2]", "[1, 2]", []),
        ("Sure: [f(x=1)]", "Sure: [f(x=1)]", []),
        ("[f(x=1e999)]", "[f(x=1e999)]", []),  # (Infinity: not JSON)
        ("[f(a=" + "-" * 6000 + "1)]", "[f(a=" + "-" * 6000 + "1)]", []),  # (the parser's stack overflows)
    ],
}


@pytest.mark.parametrize("parser", sorted(WRITTEN))
def test_each_parser_reads_its_models_calls_and_leaves_other_text_as_content(parser):
    mode = ToolMode("auto", parser=parser)
    for text, content, calls in WRITTEN[parser]:
        got_content, got = read_calls(mode, text)
        assert (got_content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got]) \
            == (content, calls), text
        if parser == "mistral":  # (Mistral's templates take nine letters and digits as a call's id)
            assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got)
        for cut in (1, 2, 5):  # streamed: what is sent as it comes and at the end is the content
            stream = ToolStream(mode)
            sent = "".join(stream.content(text[i:i + cut]) for i in range(0, len(text), cut))
            rest, streamed = stream.finish()
            assert sent + rest == (content or ""), (text, cut)
            assert [c["function"] for c in streamed] == [c["function"] for c in got]
    if parser == "mistral":  # (and so are the calls of a named function or of "required")
        tools = functions([WEATHER, TIME])
        for choice, text in (({"type": "function", "function": {"name": "get_time"}}, "{}"),
                             ("required", '[{"name": "get_time", "parameters": {}}]')):
            mode, _ = tool_mode(tools, choice, None, "mistral")
            (c,) = read_calls(mode, text)[1]
            assert len(c["id"]) == 9 and c["id"].isalnum(), choice
        assert len(ToolStream(tool_mode(tools, {"type": "function", "function": {"name": "get_time"}}, None,
                                        "mistral")[0]).arguments("{")["id"]) == 9
    assert ToolMode("auto", parser="mistral").keeps_special_tokens
    assert not ToolMode("auto", parser="hermes").keeps_special_tokens
    assert not ToolMode("named", name="f").keeps_special_tokens


def test_qwen3_coder_values_are_read_as_their_parameters_types_say():
    """Qwen3-Coder writes each value as text: the request's schema decides what it is (a string that
    looks like a number stays a string; an integer, number, boolean or object is parsed), and a value
    that does not parse as its type is kept as written."""
    tool = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "nights": {"type": "integer"}, "price": {"type": "number"},
        "pets": {"type": "boolean"}, "guests": {"type": "array"}, "note": {"type": ["string", "null"]},
        "extra": {"type": "object"}}}}}
    mode, _ = tool_mode(functions([tool]), None, None, "qwen3_coder")
    text = ("<tool_call>\n<function=book>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in [
            ("zip", "02134"), ("nights", "3"), ("price", "99.5"), ("pets", "True"), ("guests", '["a", "b"]'),
            ("note", "null"), ("extra", "not json"), ("other", "7")]) + "</function>\n</tool_call>")
    (c,) = read_calls(mode, text)[1]
    assert json.loads(c["function"]["arguments"]) == {
        "zip": "02134", "nights": 3, "price": 99.5, "pets": True, "guests": ["a", "b"], "note": "null",
        "extra": "not json", "other": 7}
    # not its type, nor strict JSON: kept as text, and the other calls stay calls
    odd = [("nights", "1_000"), ("price", "NaN"), ("guests", "[1e400]"), ("nights", "2.5"), ("price", "null")]
    text = "".join(f"<tool_call>\n<function=book>\n<parameter={k}>\n{v}\n</parameter>\n</function>\n</tool_call>"
                   for k, v in odd)
    assert [json.loads(c["function"]["arguments"]) for c in read_calls(mode, text)[1]] == [
        {"nights": "1_000"}, {"price": "NaN"}, {"guests": "[1e400]"}, {"nights": "2.5"}, {"price": None}]
    flood = "<tool_call><function=f>" + "<parameter=" * 20000  # (a model stuck repeating an opener: linear, not
    # the quadratic scan of a pattern that crosses "<", which takes minutes here)
    started = time.monotonic()
    read_calls(mode, flood)
    assert time.monotonic() - started < 2.0


def test_a_start_that_may_open_calls_is_held_until_it_is_known():
    stream = ToolStream(ToolMode("auto", parser="llama3_json"))
    assert [stream.content(p) for p in ["  ", "<|py", "thon_tag|>"]] == ["", "", ""]  # (it may still be calls)
    plain = ToolStream(ToolMode("auto", parser="llama3_json"))
    assert [plain.content(p) for p in [" ", "<|py", "x", " {"]] == ["", "", " <|pyx", " {"]
    pythonic = ToolStream(ToolMode("auto", parser="pythonic"))
    assert [pythonic.content(p) for p in ["", "\n", "Hello", " [f()]"]] == ["", "", "\nHello", " [f()]"]
    late = ToolStream(ToolMode("auto", parser="pythonic"))  # (an empty first piece decides nothing)
    assert [late.content(p) for p in ["", "[f()]"]] == ["", ""] and late.finish()[1]


def test_the_gateways_parsers_are_the_flags_choices():
    from moemesh.settings import GatewaySettings

    (flag,) = [f for f in GatewaySettings.flags() if f.name == "tool_call_parser"]
    assert set(flag.metadata["flag"].choices) == set(PARSERS)


def test_earlier_calls_reach_the_template_with_object_arguments():
    messages = [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": '{"x": 1}'}}, {"function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "3"}]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json" and out[1] == messages[1]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # (the request is left alone)
    deep = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]}]
    assert template_messages(deep) == deep  # (nesting past the parser's depth is text, not a 500)


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_a_streamed_answer_that_opens_with_whitespace_is_scanned_once(parser, monkeypatch):
    """An answer whose calls would open it is held while it is only whitespace: each piece scans what is
    new, not the whole answer again (16,000 pieces of whitespace took 6 s of the event loop), and the
    answer reads the same."""
    import dataclasses
    import re

    scanned = []

    class Counting:
        def __init__(self, pattern: re.Pattern):
            self.pattern = pattern

        def match(self, text, pos=0):
            scanned.append(len(text) - pos)
            return self.pattern.match(text, pos)

        def fullmatch(self, text, pos=0):
            scanned.append(len(text) - pos)
            return self.pattern.fullmatch(text, pos)

    base = PARSERS[parser]
    monkeypatch.setitem(PARSERS, parser, dataclasses.replace(base, opening=Counting(base.opening),
                                                             undecided=Counting(base.undecided)))
    stream = ToolStream(ToolMode("auto", parser=parser))
    pieces = [" \n"] * 2000 + ["Plain", " words."]
    sent = "".join(stream.content(p) for p in pieces)
    assert sent + stream.finish()[0] == "".join(pieces)
    assert sum(scanned) < 10 * len(pieces)
