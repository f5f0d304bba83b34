"""Anthropic's Messages API (POST /v1/messages), as vLLM and llama.cpp's server serve it, on the chat
machinery: clients written for Anthropic's SDK (and tools built on it) reach the model unchanged.

A request becomes a chat completion request (`chat_request`): `system` a system message; each
message's text blocks its content; an assistant's `tool_use` blocks its tool calls (their `input`
as JSON arguments); a user's `tool_result` blocks tool messages, before the user's text (one with
`is_error` says "Error: " before its content, as chat templates have no flag for it); earlier
`thinking` blocks dropped (chat templates drop earlier thoughts); `tools` ({name, description,
input_schema}) function tools; `tool_choice` auto, any (chat's required), tool (a named function)
or none, `disable_parallel_tool_use` parallel_tool_calls false; `thinking` enabled (or adaptive) or
disabled the template's `enable_thinking` (Qwen3) and `thinking` (DeepSeek-V3.1, Granite) variables;
`output_config`'s `format` (a JSON schema) a response_format and its `effort` the template's
`reasoning_effort`; `stop_sequences` stop strings; `max_tokens` max_completion_tokens (lowered, where the context
leaves less, to what it leaves: stop_reason model_context_window_exceeded where the answer meets
it); an assistant's text as the last message a prefill the answer continues; the sampling
fields older clients send (temperature, top_p, top_k) as they are. The chat path checks, renders and
runs it, and its answer (the thought a --reasoning-parser finds, the text, the tool calls) becomes
content blocks in the order they came (`MessageBuilder`): `thinking`, `text` and `tool_use`, with the
events of a streamed message as the answer streams.

Refused with a 400 rather than ignored: content other than text (images, documents), server tools
(web search, code execution, ...), `container` and `mcp_servers`. `thinking.budget_tokens` is taken
and not enforced (Anthropic's is a target, not a limit); thinking blocks carry an empty signature.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import jiter
import msgspec

from gateway.tools import AnswerParts

_ROLES = ("user", "assistant")


class MessagesError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class MessagesRequest(msgspec.Struct, kw_only=True):
    messages: list[Any]
    max_tokens: int
    model: str | None = None
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # not supported: refused where given
    container: Any = None
    mcp_servers: Any = None


class CountTokensRequest(MessagesRequest, kw_only=True):
    """POST /v1/messages/count_tokens: a message request without max_tokens."""
    max_tokens: int = 1


def chat_request(body: MessagesRequest) -> dict[str, Any]:
    """The chat completion request (as its JSON fields) that answers `body`; MessagesError names the
    field at fault."""
    for name in ("container", "mcp_servers"):
        if getattr(body, name) is not None:
            raise MessagesError(f"{name} is not supported by this server", name)
    messages = [{"role": "system", "content": _system(body.system)}] if body.system is not None else []
    for message in body.messages:
        messages += _messages(message)
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"] \
            and "tool_calls" not in messages[-1]:
        messages.pop()  # (an empty last assistant message, which Anthropic allows: nothing to go on from)
    elif messages and messages[-1]["role"] == "assistant" and isinstance(messages[-1]["content"], str) \
            and not messages[-1]["content"].strip() and "tool_calls" not in messages[-1]:
        raise MessagesError("messages: the final assistant message (a prefill) is only whitespace", "messages")
    # an assistant's text last is a prefill: the answer goes on from it (as Anthropic's does)
    prefill = bool(messages) and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "max_completion_tokens": body.max_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "top_k": body.top_k, "stop": body.stop_sequences}
    if body.tools:
        chat["tools"] = [_tool(t) for t in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"], parallel = _tool_choice(body.tool_choice)
        if parallel is False:
            chat["parallel_tool_calls"] = False
    kwargs: dict[str, Any] = {}
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise MessagesError("thinking must be {type: enabled, budget_tokens}, {type: adaptive} or {type: disabled}",
                                "thinking")
        kwargs.update(enable_thinking=kind != "disabled", thinking=kind != "disabled")
    config = body.output_config or {}
    if config.get("effort") is not None:
        kwargs["reasoning_effort"] = config["effort"]
    if config.get("format") is not None:
        fmt = config["format"]
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise MessagesError("output_config.format must be {type: json_schema, schema}", "output_config")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": fmt["schema"]}}
    chat["chat_template_kwargs"] = kwargs or None
    if prefill:
        chat.update(continue_final_message=True, add_generation_prompt=False)
    return {k: v for k, v in chat.items() if v is not None}


def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_block_text(b, "system") for b in system)


def _block_text(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise MessagesError(f"content blocks of type {kind!r} are not supported here by this server (text only)",
                            param)
    return block["text"]


def _messages(message: Any) -> list[dict]:
    """One Anthropic message as chat messages: a user's tool results are tool messages (before its text)."""
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or role not in _ROLES:
        raise MessagesError("each message is {role: user or assistant, content}", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise MessagesError("a message's content must be a string or a list of content blocks", "messages")
    texts, calls, results = [], [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # (an earlier thought: chat templates leave those out)
        if kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise MessagesError("a tool_use block needs an id and a name", "messages")
            if not isinstance(block.get("input", {}), dict):
                raise MessagesError("a tool_use block's input must be an object", "messages")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise MessagesError("a tool_result block needs the tool_use_id it answers", "messages")
            given = block.get("content")
            if given is not None and not isinstance(given, (str, list)):
                raise MessagesError("a tool_result's content is a string or a list of text blocks", "messages")
            text = given if isinstance(given, str) else "\n".join(_block_text(b, "messages") for b in given or [])
            if block.get("is_error") is True:  # (chat templates have no such flag: the model reads it)
                text = f"Error: {text}" if text else "Error"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            texts.append(_block_text(block, "messages"))
    out = list(results)
    if texts or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else (None if calls else "")}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _tool(tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise MessagesError(f"tools of type {kind!r} are not supported by this server (custom tools: name, "
                            f"description, input_schema)", "tools")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict) -> tuple[Any, bool | None]:
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise MessagesError("tool_choice must be {type: auto}, {type: any}, {type: tool, name} or {type: none}",
                        "tool_choice")


# the chat request's fields a 400 may name -> this API's names for them
FIELDS = {"max_completion_tokens": "max_tokens", "response_format": "output_config", "stop": "stop_sequences"}
NAMES = {"response_format": "output_config.format"}  # (where a message names the field otherwise than its param)


def error_body(kind_of_status: int, message: str) -> dict:
    """Anthropic's error object for an HTTP status."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error"}.get(kind_of_status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessageBuilder(AnswerParts):
    """One message's content blocks as its answer comes (`add`: a chat delta's reasoning, content and
    tool-call entries), and the events a stream sends for them (`take`). A streamed message and a whole
    one are built alike. capped: the answer's max_tokens was lowered to what the context leaves, so an
    answer cut there ends for the context window, not for max_tokens."""
    THOUGHT, TEXT = "thinking", "text"  # (the content blocks' types)

    def __init__(self, model: str, prompt_tokens: int, capped: bool = False):
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.content: list[dict] = []
        self.open: int | None = None  # the place of the block being written (thinking, text, tool_use), if any
        self.calls: dict[int, int] = {}  # tool-call entries' index -> their tool_use block's place
        self.arguments: dict[int, str] = {}  # a tool_use block's place -> its input's JSON so far
        self.sent: dict[int, int] = {}  # ... -> how much of it has streamed (leading whitespace waits)
        self.events: list[dict] = []
        self.started = False
        self.prompt_tokens, self.capped, self.cached_tokens = prompt_tokens, capped, 0

    def take(self) -> list[dict]:
        """The events since the last take (message_start first)."""
        if not self.started:
            self.started = True
            self.events.insert(0, {"type": "message_start", "message": self.message(None, None, usage={
                "input_tokens": self.prompt_tokens - self.cached_tokens, "output_tokens": 0,
                "cache_read_input_tokens": self.cached_tokens, "cache_creation_input_tokens": 0})})
        out, self.events = self.events, []
        return out

    def _count(self, tokens: int, thinking: bool, cached_tokens: int | None) -> None:
        if cached_tokens is not None:  # (for message_start; Anthropic's usage has no thinking tokens)
            self.cached_tokens = cached_tokens

    def _begin_call(self, index: int, call_id: str, name: str) -> None:
        self.calls[index] = self.open = self._start({"type": "tool_use", "id": call_id, "name": name, "input": {}})
        self.arguments[self.open], self.sent[self.open] = "", 0

    def _arguments(self, index: int, piece: str) -> None:
        at = self.calls[index]
        self.arguments[at] += piece
        shown = self.arguments[at].lstrip()  # (a partial JSON reader takes no lone whitespace)
        if len(shown) > self.sent[at]:
            self._event("content_block_delta", index=at,
                        delta={"type": "input_json_delta", "partial_json": shown[self.sent[at]:]})
            self.sent[at] = len(shown)

    def finish(self, finish_reason: str | None, prompt_tokens: int, output_tokens: int, cached_tokens: int,
               stop_string: str | None = None) -> dict:
        """The whole message, once the answer has ended (its last events sent with it). stop_string: the
        stop sequence that ended it, if one did."""
        self._close()
        if finish_reason == "length":
            reason = "model_context_window_exceeded" if self.capped else "max_tokens"
        elif stop_string is not None:
            reason = "stop_sequence"
        elif self.calls:
            reason = "tool_use"
        else:
            reason = "end_turn"
        stop_string = stop_string if reason == "stop_sequence" else None
        usage = {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
                 "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}
        self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": stop_string}, usage=usage)
        self._event("message_stop")
        return self.message(reason, stop_string, usage)

    def error(self, status: int, message: str, param: str | None = None, code: Any = None) -> None:
        """An error mid-stream: Anthropic's error event."""
        self._event("error", **{k: v for k, v in error_body(status, message).items() if k != "type"})

    def message(self, reason: str | None, stop_string: str | None, usage: dict) -> dict:
        content = []
        for index, block in enumerate(self.content if reason is not None else ()):
            if block["type"] == "tool_use":
                block = {**block, "input": _input(self.arguments[index])}
            content.append(dict(block))
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop_string, "usage": usage}

    # -- blocks and their events -----------------------------------------------------------

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, **fields})

    def _start(self, block: dict) -> int:
        """A new block: its place."""
        self.content.append(block)
        self._event("content_block_start", index=len(self.content) - 1, content_block=dict(block))
        return len(self.content) - 1

    def _text(self, kind: str, piece: str) -> None:
        """A piece of the thought (thinking) or of the answer's text (text), into the open block of that
        kind or a new one."""
        if self.open is None or self.content[self.open]["type"] != kind:
            self._close()
            self.open = self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else
                                    {"type": "text", "text": ""})
        self.content[self.open][kind] += piece
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else \
            {"type": "text_delta", "text": piece}
        self._event("content_block_delta", index=self.open, delta=delta)

    def _close(self) -> None:
        """The open block is done (another block or the end follows)."""
        at, self.open = self.open, None
        if at is not None:
            self._event("content_block_stop", index=at)


def _input(arguments: str) -> dict:
    """A tool_use block's input: its arguments' object. Arguments cut short (max_tokens) are read as
    Anthropic's SDK reads a stream's `input_json_delta`s (jiter's partial mode: what is whole of them),
    so that a whole response and a streamed one agree; {} for what is no object (nesting past the
    parser's depth, as a schema's recursion can force, included)."""
    try:
        value = jiter.from_json(arguments.encode(), partial_mode=True, allow_inf_nan=False) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
