"""Tool calling in /v1/chat/completions, as OpenAI's API and vLLM's server do it.

The request's `tools` are rendered by the model's chat template (its `tools` variable), and an
assistant message's earlier `tool_calls` have their arguments parsed into objects for it, as vLLM
hands them to templates. What `tool_choice` asks decides how the answer is made and read:
- a named function ({"type": "function", "function": {"name": ...}}): the answer is constrained to
  a JSON object of that function's `parameters` schema (moemesh/structured.py; at most one space
  where JSON allows whitespace: CALL_WHITESPACE) and comes back as one tool call whose arguments
  are the text; finish_reason "stop", as OpenAI's;
- "required": constrained to a JSON array of one or more {"name", "parameters"} objects, one
  of the tools each (one at most with parallel_tool_calls false), which come back as tool calls;
  finish_reason "tool_calls";
- "auto" (the default when tools are given): the model decides, and the gateway's
  `--tool-call-parser` reads its calls from the text (`hermes`: `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks, the format of Qwen2.5, Qwen3 and Hermes models). Without
  a parser "auto" is refused (a 400), as vLLM refuses it without --enable-auto-tool-choice;
- "none": the tools are rendered, and the answer is text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes",)
# a constrained call's JSON takes at most one space where JSON allows whitespace, and no newline: a
# model cannot pad a call until max_tokens (vLLM allows any; a function's schema may say otherwise in
# its own "x-guidance")
CALL_WHITESPACE = {"whitespace_pattern": "[ ]?"}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolMode:
    """How a chat completion's answer is read: "named" (its text is the arguments of `name`),
    "required" (a JSON array of calls) or "auto" (calls found in the text by `parser`; only the first
    where `parallel` is false)."""
    kind: str
    name: str | None = None
    parser: str | None = None
    parallel: bool = True


def functions(tools: Any) -> list[dict]:
    """The request's tools, checked: each {"type": "function", "function": {"name", ...}} (400 otherwise)."""
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError("each tool must be {type: function, function: {name, parameters}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError("each tool's function needs a name", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"function {fn['name']}'s parameters must be a JSON schema object", "tools")
        out.append({**tool, "type": "function"})
    return out


def tool_mode(tools: list[dict] | None, tool_choice: Any, parallel: bool | None, parser: str | None) \
        -> tuple[ToolMode | None, dict | None]:
    """(how the answer is read, the structured-output fields that constrain it: guided_json's schema),
    each None where the answer is plain text."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None, None
    if not tools:
        raise ToolError(f"tool_choice {tool_choice if isinstance(tool_choice, str) else 'of a function'} needs tools",
                        "tool_choice")
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if tool_choice == "auto":
        if parser is None:
            raise ToolError('"auto" tool choice needs a tool-call parser: start the gateway with --tool-call-parser '
                            '(or give tool_choice "required", "none" or a function)', "tool_choice")
        return ToolMode("auto", parser=parser, parallel=parallel is not False), None
    if tool_choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": _parameters(fn)},
             "required": ["name", "parameters"], "additionalProperties": False} for name, fn in by_name.items()]},
            "x-guidance": CALL_WHITESPACE, **_shared_definitions(by_name)}
        if parallel is False:
            calls["maxItems"] = 1
        return ToolMode("required"), {"guided_json": calls}
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name or tool_choice.get("type", "function") != "function":
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    if name not in by_name:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    schema = _parameters(by_name[name])
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    if "whitespace_flexible" not in own and "whitespace_pattern" not in own:
        schema = {**schema, "x-guidance": {**own, **CALL_WHITESPACE}}
    return ToolMode("named", name=name), {"guided_json": schema}


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object"}


def _shared_definitions(by_name: dict[str, dict]) -> dict:
    """The functions' `$defs` and `definitions`, gathered at the root of the "required" schema that nests
    their parameters, where their local references ("#/$defs/X") point (400 for two that differ)."""
    shared: dict[str, dict] = {}
    for name, fn in by_name.items():
        for key in ("$defs", "definitions"):
            defs = _parameters(fn).get(key)
            if not isinstance(defs, dict):
                continue
            for def_name, schema in defs.items():
                if shared.setdefault(key, {}).setdefault(def_name, schema) != schema:
                    raise ToolError(f"tool_choice required: two functions define {key}/{def_name} differently "
                                    f"(name them apart, or call one function by name)", "tools")
    return shared


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant messages' tool_calls with their arguments as objects, as chat templates read them
    (OpenAI sends them as JSON text; one that is not JSON is left as text)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def read_calls(mode: ToolMode, text: str) -> tuple[str | None, list[dict]]:
    """A finished answer's (content, tool calls). Text that does not read as calls stays content."""
    if mode.kind == "named":
        return None, [call(mode.name, text)]
    if mode.kind == "required":
        try:
            calls = json.loads(text)
            return None, [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
        except (ValueError, TypeError, KeyError):  # (cut short by max_tokens: not JSON yet)
            return text, []
    content, calls = _hermes(text)
    return content, calls if mode.parallel else calls[:1]


_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    try:
        for block in _HERMES_BLOCK.findall(text[start:]):
            c = json.loads(block)
            arguments = c.get("arguments", c.get("parameters", {}))
            if not isinstance(c.get("name"), str):
                raise ValueError("a call without a name")
            calls.append(call(c["name"], arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)))
    except (ValueError, TypeError, AttributeError):  # (not calls after all: the text is the answer)
        return text, []
    return text[:start] or None, calls  # (the text before the calls, as it streams: vLLM's)


class ToolStream:
    """A streamed choice's text, split into what can be sent as content now and what is held for the
    calls read at its end. named: every piece is arguments of the one call; required: all is held;
    auto: content streams until a `<tool_call>` begins (a tail that could be its start waits)."""

    def __init__(self, mode: ToolMode):
        self.mode, self.text, self.sent = mode, "", 0
        self.held = mode.kind == "required"

    def arguments(self, piece: str) -> dict | None:
        """named: the delta's tool-call entry for a piece of the arguments (the first names the call)."""
        if not piece:
            return None
        first, self.text = not self.text, self.text + piece
        if not first:
            return {"index": 0, "function": {"arguments": piece}}
        return {"index": 0, **call(self.mode.name, piece)}

    def content(self, piece: str) -> str:
        """required and auto: the new text's part that is content to send now."""
        self.text += piece
        if self.held:  # (required: always)
            return ""
        start = self.text.find(HERMES_OPEN, max(0, self.sent - len(HERMES_OPEN)))
        if start >= 0:
            self.held = True
            end = start
        else:
            end = len(self.text) - _partial_suffix(self.text, HERMES_OPEN)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """At the choice's end (required, auto): (content still to send, its calls)."""
        content, calls = read_calls(self.mode, self.text)
        if not calls:
            return self.text[self.sent:], []
        return "", calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of text's longest tail that is a proper start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
