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
  `--tool-call-parser` reads its calls from the text (PARSERS: the formats of Qwen, Qwen3-Coder,
  Hermes, Mistral and Llama models). Without a parser "auto" is refused (a 400), as vLLM refuses it without
  --enable-auto-tool-choice;
- "none": the tools are rendered, and the answer is text.
"""

from __future__ import annotations

import abc
import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable

# a constrained call's JSON takes at most one space where JSON allows whitespace, and no newline: a
# model cannot pad a call until max_tokens (vLLM allows any; a function's schema may say otherwise in
# its own "x-guidance")
CALL_WHITESPACE = {"whitespace_pattern": "[ ]?"}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


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
    # each function's parameters' JSON schema types, for a parser whose calls write values as text (qwen3_coder)
    types: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def call_id(self) -> str | None:
        """An id for a call (None: OpenAI's kind), as the parser's models take them back (mistral's nine
        letters and digits), whatever the tool_choice."""
        return PARSERS[self.parser].call_id() if self.parser is not None else None

    @property
    def keeps_special_tokens(self) -> bool:
        """Its parser looks for a special token ([TOOL_CALLS]), which the answer's text must keep (as
        vLLM's mistral parser has it)."""
        return self.kind == "auto" and PARSERS[self.parser].special


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
        return ToolMode("auto", parser=parser, parallel=parallel is not False,
                        types=_types(by_name) if PARSERS[parser].typed else ()), None
    if tool_choice == "required":
        # each function's parameters under $defs at the root, their references to their own root ("#": a
        # recursive schema; "#/$defs/X", "#/properties/a") pointed there: each call's constraint is its schema
        where = {name: f"call{i}" for i, name in enumerate(by_name)}
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name},
                                              "parameters": {"$ref": f"#/$defs/{where[name]}"}},
             "required": ["name", "parameters"], "additionalProperties": False} for name in by_name]},
            "x-guidance": CALL_WHITESPACE,
            "$defs": {where[name]: _rooted(_parameters(fn), f"#/$defs/{where[name]}")
                      for name, fn in by_name.items()}}
        if parallel is False:
            calls["maxItems"] = 1
        return ToolMode("required", parser=parser), {"guided_json": calls}
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
    return ToolMode("named", name=name, parser=parser), {"guided_json": schema}


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or {"type": "object"}


def _types(by_name: dict[str, dict]) -> tuple:
    """Each function's parameters' types ("string", "integer", ...; the first of a list), where the schema
    says."""
    out = []
    for name, fn in by_name.items():
        properties = _parameters(fn).get("properties")
        types = []
        for param, schema in (properties.items() if isinstance(properties, dict) else ()):
            kind = schema.get("type") if isinstance(schema, dict) else None
            kind = next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind
            if isinstance(kind, str):
                types.append((param, kind))
        out.append((name, tuple(types)))
    return tuple(out)


MAX_SCHEMA_DEPTH = 128  # (a request's JSON nests up to ~1,000 levels; llguidance refuses schemas far shallower)


def _rooted(schema: Any, root: str, depth: int = 0) -> Any:
    """`schema` moved to `root`: each reference by pointer from its root ("#", "#/...") made to point
    inside it there. A subschema with its own `$id` is a resource of its own, whose references are its
    own, and an anchor ("#name") names a place wherever it is: both left alone. Literal values (const,
    enum, default, examples) are data, left alone too; the maps of named subschemas (properties,
    $defs, ...) are names, each mapped to a schema. Deeper than MAX_SCHEMA_DEPTH: a ToolError (a walk
    that deep would run out of Python's stack: a 500 and a traceback in the log for a 2 KB body)."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ToolError(f"a tool's parameters nest deeper than {MAX_SCHEMA_DEPTH} levels", "tools")
    if isinstance(schema, list):
        return [_rooted(s, root, depth + 1) for s in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: _rooted(sub, root, depth + 1) for name, sub in value.items()}
        elif key in ("const", "enum", "default", "examples"):
            out[key] = value
        else:
            out[key] = _rooted(value, root, depth + 1)
    return out


_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant messages' tool_calls with their arguments as objects, as chat templates read them
    (OpenAI sends them as JSON text; one that is not JSON is left as text). ToolError where a call is
    not OpenAI's {id, type: function, function: {name, arguments}} (with arguments a string)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(map(_is_call, calls)):
                raise ToolError("an assistant message's tool_calls must be a list of {id, type: function, function: "
                                "{name, arguments}} objects, arguments a JSON string or an object", "messages")
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _is_call(call: Any) -> bool:
    """OpenAI's shape of an earlier call; arguments as an object too, or left out (as vLLM takes them)."""
    fn = call.get("function") if isinstance(call, dict) else None
    return (isinstance(fn, dict) and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments", {}), (str, dict))
            and isinstance(call.get("id", ""), str) and call.get("type", "function") == "function")


def _with_object_arguments(call: dict) -> dict:
    fn = call["function"]
    if not isinstance(fn.get("arguments"), str):  # (an object already, or none: vLLM's {})
        return {**call, "function": {**fn, "arguments": fn.get("arguments", {})}}
    try:
        arguments = json.loads(fn["arguments"])
    except (ValueError, RecursionError):  # (nesting past the parser's depth: text too)
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def read_calls(mode: ToolMode, text: str) -> tuple[str | None, list[dict]]:
    """A finished answer's (content, tool calls). Text that does not read as calls stays content."""
    if mode.kind == "named":
        return None, [call(mode.name, text, mode.call_id())]
    if mode.kind == "required":
        try:
            calls = json.loads(text)
            return None, [call(c["name"], _json(c["parameters"]), mode.call_id()) for c in calls]
        except (ValueError, TypeError, KeyError, RecursionError, MemoryError):  # (cut short by max_tokens)
            # the calls written, the last with the arguments it had (as a named call cut short has); the
            # constraint's JSON is no answer to show as content
            return None, [call(name, arguments, mode.call_id()) for name, arguments in _calls_begun(text)]
    parser = PARSERS[mode.parser]
    start = parser.begin(text)
    if start is None:
        return text, []
    try:
        found = parser.read(text[start:], dict(mode.types)) if parser.typed else parser.read(text[start:])
        calls = [call(name, arguments, mode.call_id()) for name, arguments in found]
    # (ast.parse of deep nesting: RecursionError, or MemoryError "parser stack overflowed")
    except (ValueError, TypeError, AttributeError, KeyError, SyntaxError, RecursionError, MemoryError):
        calls = []  # (not calls after all: the text is the answer)
    if not calls:
        return text, []
    # the text before the calls, as it streams (vLLM's)
    return text[:start] or None, calls if mode.parallel else calls[:1]


# a call of the "required" array as its constraint writes it: {"name": "...", "parameters": {...}}
_REQUIRED_CALL = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')
_REQUIRED_CALL_END = re.compile(r"\s*\}")


def _calls_begun(text: str) -> list[tuple[str, str]]:
    """A "required" answer cut short: (name, arguments) of each call whose name was written whole; the
    arguments as written where the last call's were cut short."""
    calls, at = [], 0
    while (head := _REQUIRED_CALL.match(text, at)) is not None:
        name = json.loads(head.group(1))
        try:
            arguments, end = json.JSONDecoder().raw_decode(text, head.end())
            calls.append((name, _json(arguments)))
        except (ValueError, RecursionError):
            calls.append((name, text[head.end():]))
            break
        if (close := _REQUIRED_CALL_END.match(text, end)) is None:
            break
        at = close.end()
    return calls


def _arguments(c: Any) -> tuple[str, str]:
    """(name, arguments as JSON text) of a call written as {"name": ..., "arguments" or "parameters": {...}}
    (an object without either is not a call: a JSON answer that has a "name", say). Arguments are an
    object, or a string of one (a string that is not is no call: clients parse arguments as an object)."""
    if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
        raise ValueError("a call without a name")
    arguments = c["arguments"] if "arguments" in c else c["parameters"]
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a call's arguments are an object")
    return c["name"], _json(arguments)


def _json(value: Any) -> str:
    """Arguments as strict JSON (no NaN or Infinity, which JSON.parse refuses: a ValueError, so not a call)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.S)


def _hermes(text: str) -> list[tuple[str, str]]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (the last may be left open at the end)."""
    return [_arguments(json.loads(block)) for block in _HERMES_BLOCK.findall(text)]


def _mistral(text: str) -> list[tuple[str, str]]:
    """After each [TOOL_CALLS]: a JSON array of {"name", "arguments"} (Mistral's v3 tokenizers: Mixtral-8x22B,
    Mistral 7B v0.3), one such object, or name[ARGS]{...} (v11 tokenizers) or name{...}."""
    calls = []
    for part in text.split(MISTRAL_CALLS)[1:]:
        part = part.strip()
        if part.startswith(("[", "{")):
            given = json.loads(part)
            calls += [_arguments(c) for c in (given if isinstance(given, list) else [given])]
            continue
        name, sep, arguments = part.partition(MISTRAL_ARGS)
        if not sep:
            brace = part.find("{")
            if brace < 0:
                raise ValueError("a call without arguments")
            name, arguments = part[:brace], part[brace:]
        if not isinstance(parsed := json.loads(arguments), dict) or not name.strip():
            raise ValueError("a call's arguments are an object")
        calls.append((name.strip(), _json(parsed)))
    return calls


# (names hold no "<": a scan from each opener stops at the next, so a run of openers stays linear)
_QWEN3_CODER_CALL = re.compile(r"<function=([^<>\n]+)>(.*?)(?:</function>|$)", re.S)
_QWEN3_CODER_PARAMETER = re.compile(r"<parameter=([^<>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _qwen3_coder(text: str, types: dict[str, tuple[tuple[str, str], ...]]) -> list[tuple[str, str]]:
    """<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call> blocks, as
    Qwen3-Coder writes calls (XML-like, a value as text): each value is read as its parameter's schema
    type says (a string kept as written; integer, number, boolean, object, array parsed), or as JSON
    where the schema says nothing and it is JSON, else as the text."""
    calls = []
    for block in _HERMES_BLOCK.findall(text):
        found = _QWEN3_CODER_CALL.search(block)
        if found is None:
            raise ValueError("a call without <function=...>")
        name, body = found.group(1).strip(), found.group(2)
        kinds = dict(types.get(name, ()))
        arguments = {param.strip(): _typed(value, kinds.get(param.strip()))
                     for param, value in _QWEN3_CODER_PARAMETER.findall(body)}
        calls.append((name, _json(arguments)))
    return calls


def _typed(value: str, kind: str | None) -> Any:
    """A qwen3_coder parameter's text as its schema's type (its newlines around it dropped), or the text
    as written where it is not one (nor strict JSON: no NaN or Infinity)."""
    value = value.removeprefix("\n").removesuffix("\n")
    text = value.strip()
    if kind == "string":
        return value
    if text == "null":
        return None
    if kind == "boolean":
        return text.lower() == "true" if text.lower() in ("true", "false") else value
    try:
        parsed = json.loads(text)
        _json(parsed)
    except (ValueError, RecursionError):
        return value
    numeric = isinstance(parsed, (int, float)) and not isinstance(parsed, bool)
    if kind == "integer":
        return parsed if numeric and parsed == int(parsed) and isinstance(parsed, int) else value
    if kind == "number":
        return parsed if numeric else value
    return parsed  # (object, array, or no type said)


_JSON = json.JSONDecoder()
_LLAMA_TAG = "<|python_tag|>"


def _llama3_json(text: str) -> list[tuple[str, str]]:
    """{"name": ..., "parameters": {...}} objects, `;` between them, as Llama 3.1-3.3 write calls (after an
    optional <|python_tag|>, where special tokens are shown)."""
    text = text.strip().removeprefix(_LLAMA_TAG)
    calls, at = [], 0
    while True:
        at = len(text) - len(text[at:].lstrip())
        c, at = _JSON.raw_decode(text, at)
        calls.append(_arguments(c))
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            raise ValueError("calls are separated by ;")
        at = len(text) - len(rest) + 1


_PYTHONIC_TAGS = ("<|python_start|>", "<|python_end|>")


def _pythonic(text: str) -> list[tuple[str, str]]:
    """[f(a=1, b="x"), g()]: a Python list of calls with literal keyword arguments, as Llama 3.2 and 4
    write them (between <|python_start|> and <|python_end|> where special tokens are shown)."""
    text = text.strip()
    for tag in _PYTHONIC_TAGS:
        text = text.replace(tag, "")
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List):
        raise ValueError("calls are a list")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                or any(k.arg is None for k in node.keywords):
            raise ValueError("a call is name(keyword=literal, ...)")
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        calls.append((node.func.id, _json(arguments)))
    return calls


def _mistral_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse other tool call ids in later turns."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class Parser:
    """A --tool-call-parser: where an answer's calls begin, and how they read.
    marker: the calls begin where it first appears, after content (hermes, mistral); or, with `opening`,
    only at the answer's start, which matches `opening` (llama3_json, pythonic) and is then not content.
    special: the marker is a special token, kept in the answer's text for it."""
    read: Callable[[str], list[tuple[str, str]]]
    marker: str | None = None
    opening: re.Pattern | None = None  # (its group 1: where the calls begin)
    undecided: re.Pattern | None = None  # an answer's start that may still open calls (held back)
    special: bool = False
    call_id: Callable[[], str | None] = lambda: None
    typed: bool = False  # read takes the functions' parameter types too (ToolMode.types)

    def begin(self, text: str, after: int = 0, blank: int = 0) -> int | None:
        """Where text's calls begin (searching from `after`), or None where there are none yet. blank:
        text's first characters known to be whitespace (a stream's: not scanned again at each piece)."""
        if self.marker is not None:
            at = text.find(self.marker, after)
            return None if at < 0 else at
        return 0 if self.opening.match(text, blank) else None

    def hold(self, text: str, blank: int = 0) -> int:
        """The length of text's tail that may yet begin calls, and is not sent as content yet."""
        if self.marker is not None:
            return partial_suffix(text, self.marker)
        return len(text) if self.undecided.fullmatch(text, blank) else 0


def _starts(opener: str, *tags: str) -> dict[str, re.Pattern]:
    """opening: an answer that opens with `opener`, after whitespace and any of tags; undecided: one that
    may yet."""
    tag = "|".join(re.escape(t) for t in tags)
    prefixes = "|".join(re.escape(t[:k]) for t in tags for k in range(1, len(t) + 1))
    return {"opening": re.compile(rf"\s*(?:(?:{tag})\s*)?{re.escape(opener)}"),
            "undecided": re.compile(rf"\s*(?:(?:{tag})\s*|{prefixes})?")}


PARSERS = {
    "hermes": Parser(_hermes, marker=HERMES_OPEN),
    "qwen3_coder": Parser(_qwen3_coder, marker=HERMES_OPEN, typed=True),
    "mistral": Parser(_mistral, marker=MISTRAL_CALLS, special=True, call_id=_mistral_id),
    "llama3_json": Parser(_llama3_json, **_starts("{", _LLAMA_TAG)),
    "pythonic": Parser(_pythonic, **_starts("[", _PYTHONIC_TAGS[0])),
}


class ToolStream:
    """A streamed choice's text, split into what can be sent as content now and what is held for the
    calls read at its end. named: every piece is arguments of the one call; required: all is held;
    auto: content streams until the parser's calls begin (a tail that could begin them waits)."""

    def __init__(self, mode: ToolMode):
        self.mode, self.text, self.sent = mode, "", 0
        self.held = mode.kind == "required"
        self.parser = PARSERS[mode.parser] if mode.kind == "auto" else None
        self.plain = False  # the answer's start says it is no calls (a parser whose calls open it)
        self.blank = 0  # the text's leading whitespace so far (an opening is matched after it)

    def arguments(self, piece: str) -> dict | None:
        """named: the delta's tool-call entry for a piece of the arguments (the first names the call)."""
        if not piece:
            return None
        first, self.text = not self.text, self.text + piece
        if not first:
            return {"index": 0, "function": {"arguments": piece}}
        return {"index": 0, **call(self.mode.name, piece, self.mode.call_id())}

    def content(self, piece: str) -> str:
        """required and auto: the new text's part that is content to send now."""
        self.text += piece
        if self.held:  # (required: always)
            return ""
        if self.plain:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        while self.blank < len(self.text) and self.text[self.blank].isspace():  # (as re's \s: str.isspace)
            self.blank += 1
        start = self.parser.begin(self.text, max(0, self.sent - len(self.parser.marker or "")), self.blank)
        if start is not None:
            self.held = True
            end = start
        else:
            end = len(self.text) - self.parser.hold(self.text, self.blank)
            self.plain = self.parser.marker is None and bool(self.text) and end == len(self.text)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """At the choice's end (required, auto): (content still to send, its calls)."""
        content, calls = read_calls(self.mode, self.text)
        if not calls:
            return ("" if content is None else self.text[self.sent:]), []
        return "", calls


class AnswerParts(abc.ABC):
    """A chat answer taken delta by delta (`add`: the thought, the text and the tool calls a streamed chat
    delta carries) into another API's parts: gateway/responses.py's items, gateway/messages.py's blocks.
    A subclass says what each part becomes: `_text` (kind THOUGHT or TEXT), `_begin_call`, `_arguments`,
    `_close` (the part being written is done), and `_count` (the delta's tokens)."""
    THOUGHT, TEXT = "thought", "text"

    def add(self, delta: dict, tokens: int = 0, thinking: bool = False, cached_tokens: int | None = None) -> None:
        """A chat delta of the answer. tokens: how many it took; thinking: they were (some of them) the
        thought's; cached_tokens: with the first tokens, the prompt tokens the prefix cache held."""
        self._count(tokens, thinking, cached_tokens)
        if delta.get("reasoning"):
            self._text(self.THOUGHT, delta["reasoning"])
        if delta.get("content"):
            self._text(self.TEXT, delta["content"])
        for entry in delta.get("tool_calls") or ():
            fn = entry.get("function") or {}
            if "id" in entry:  # a call begins (named: its arguments follow; auto, required: they are whole)
                self._close()
                self._begin_call(entry.get("index", 0), entry["id"], fn.get("name", ""))
            self._arguments(entry.get("index", 0), fn.get("arguments") or "")

    def _count(self, tokens: int, thinking: bool, cached_tokens: int | None) -> None:
        pass

    @abc.abstractmethod
    def _text(self, kind: str, piece: str) -> None: ...

    @abc.abstractmethod
    def _begin_call(self, index: int, call_id: str, name: str) -> None: ...

    @abc.abstractmethod
    def _arguments(self, index: int, piece: str) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...


def partial_suffix(text: str, marker: str) -> int:
    """The length of text's longest tail that is a proper start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
