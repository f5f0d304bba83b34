"""OpenAI's Responses API (POST /v1/responses), as vLLM serves it, on the chat machinery.

A request becomes a chat completion request (`chat_request`): `instructions` a system message,
`input` the messages (text, or items: messages with text parts, earlier `function_call`s and their
`function_call_output`s; earlier `reasoning` items are dropped, as chat templates drop earlier
thoughts), function `tools` and `tool_choice` in chat's shape, `text.format` a response_format,
`max_output_tokens` max_completion_tokens, `reasoning.effort` the template's `reasoning_effort`
(as vLLM hands it). The chat path then checks, renders and runs it, and its answer (the thought a
--reasoning-parser finds, the content, the tool calls) becomes the response's output items: a
`reasoning` item, a `message` with one `output_text`, `function_call` items, in the order they came
(`ResponseBuilder`), with the events of a streamed response as the answer streams.

Responses are kept (`store`, true unless the request says false, as OpenAI's) in this gateway's
memory (`ResponseStore`: the newest --max-stored-responses, and at most STORE_CHARS characters of
them; none with 0): `GET /v1/responses/{id}`, its `input_items`, `DELETE`, and a later request's
`previous_response_id`, which continues that response's conversation (its input and output, and those
of the responses it continued; not its instructions, as OpenAI's). They are not shared between
gateways, nor kept across a restart: behind several gateways a client that chains responses needs to
reach the same one (or sends the conversation as input).

Not served, and refused with a 400 naming the field rather than ignored: `background`, `include`,
`truncation: auto`, `top_logprobs`, `max_tool_calls`, `conversation`, `prompt` (templates), tools other
than functions, and input other than text (images, files, audio).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.tools import AnswerParts

# the input item types read, and the content part types taken as text (an assistant's earlier answer
# comes back as output_text; refusal text as refusal)
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


# the chat request's fields a 400 may name -> the Responses API's names for them
FIELDS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text"}
NAMES = {"response_format": "text.format"}  # (where a message names the field otherwise than its param)


class ResponsesError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True  # kept for GET /v1/responses/{id} and previous_response_id (where the gateway keeps any)
    previous_response_id: str | None = None
    cache_salt: str | None = None  # (vLLM's: the prefix cache shares this prompt only with the same salt's)
    # not supported: refused where given (`_refuse_unsupported`)
    background: bool = False
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None


def _refuse_unsupported(body: ResponsesRequest) -> None:
    why = {"background": "background responses are not supported by this server",
           "include": "include is not supported by this server",
           "truncation": "truncation auto is not supported by this server (a prompt too long is refused)",
           "top_logprobs": "top_logprobs is not supported by this server's responses",
           "max_tool_calls": "max_tool_calls is not supported by this server",
           "conversation": "conversations are not served by this server (chain responses with "
                           "previous_response_id, or send the conversation as input)",
           "prompt": "prompt templates are not served by this server (send the prompt as input and "
                     "instructions)"}
    given = {"background": body.background,
             "include": bool(body.include), "truncation": body.truncation not in (None, "disabled"),
             "top_logprobs": bool(body.top_logprobs), "max_tool_calls": body.max_tool_calls is not None,
             "conversation": body.conversation is not None, "prompt": body.prompt is not None}
    for name, on in given.items():
        if on:
            raise ResponsesError(why[name], name)


def chat_request(body: ResponsesRequest, previous: Stored | None = None) -> dict[str, Any]:
    """The chat completion request (as its JSON fields) that answers `body`, continuing the conversation
    of `previous` (its previous_response_id's) where given; ResponsesError names the field at fault."""
    _refuse_unsupported(body)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += (previous.messages if previous is not None else []) + _messages(body.input)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
                            "cache_salt": body.cache_salt}
    if body.tools:
        chat["tools"] = [_tool(t) for t in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and not (isinstance(effort, str) and effort):
        raise ResponsesError("reasoning.effort must be a string, e.g. low, medium or high", "reasoning")
    if effort is not None:
        chat["chat_template_kwargs"] = {"reasoning_effort": effort}
    return {k: v for k, v in chat.items() if v is not None}


def _messages(given: Any) -> list[dict]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict] = []
    for item in given:
        if not isinstance(item, dict):
            raise ResponsesError("input must be a string or a list of items (messages, function calls and their "
                                 "outputs)", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
            if role is None:
                raise ResponsesError(f"an input message's role must be one of {', '.join(_ROLES)}", "input")
            out.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id"), "type": "function",
                    "function": {"name": _string(item, "name"), "arguments": _string(item, "arguments")}}
            if out and out[-1]["role"] == "assistant":  # (an answer's text and calls: one assistant turn)
                out[-1]["tool_calls"] = [*(out[-1].get("tool_calls") or []), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id"),
                        "content": output if isinstance(output, str) else _text(output)})
        elif kind == "reasoning":
            continue  # (an earlier thought: chat templates leave those out)
        elif not isinstance(kind, str):
            raise ResponsesError("each input item needs a type (or a role: a message)", "input")
        else:
            raise ResponsesError(f"input items of type {kind!r} are not supported by this server (messages, "
                                 f"function_call, function_call_output, reasoning)", "input")
    return out


def _string(item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ResponsesError(f"a {item.get('type')} input item needs {key} as a string", "input")
    return value


def _text(content: Any) -> str | list[dict]:
    """A message's content: a string, or its text parts in chat's shape (the chat path joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError("an input message's content must be a string or a list of parts", "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS or not isinstance(part.get(_TEXT_PARTS[kind]), str):
            raise ResponsesError(f"content parts of type {kind!r} are not supported by this server (text only)",
                                 "input")
        parts.append({"type": "text", "text": part[_TEXT_PARTS[kind]]})
    return parts


def _tool(tool: Any) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ResponsesError(f"tools of type {kind!r} are not supported by this server (function tools only)",
                             "tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ResponsesError("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")


def _format(fmt: Any) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "answer", "schema": fmt["schema"]}}
    raise ResponsesError("text.format must be {type: text}, {type: json_object} or {type: json_schema, name, "
                         "schema}", "text")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- kept responses -------------------------------------------------------------------------------

STORE_CHARS = 64 << 20  # characters of JSON the kept responses may hold in all (the oldest go first)


@dataclass(frozen=True)
class Stored:
    response: dict  # as it was answered
    input_items: list[dict]  # its input, as items with ids (GET .../input_items)
    messages: list[dict]  # its conversation as chat messages: those it continued, its input, its output
    size: int  # characters of JSON, counted against STORE_CHARS


class ResponseStore:
    """The newest `max_responses` responses (and at most `max_chars` characters of them), by id."""

    def __init__(self, max_responses: int, max_chars: int = STORE_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self.kept: OrderedDict[str, Stored] = OrderedDict()
        self.chars = 0

    def get(self, response_id: str) -> Stored | None:
        return self.kept.get(response_id)

    def put(self, body: ResponsesRequest, previous: Stored | None, response: dict) -> None:
        """Keeps a finished response (and what continuing it needs) if its request asked for it."""
        if not (body.store and self.max_responses):
            return
        items = _input_items(body.input)
        own = _messages(body.input) + _messages(response["output"])
        messages = (previous.messages if previous is not None else []) + own
        # (a chain's earlier messages are the same objects as its earlier responses': each counts its own)
        size = sum(len(json.dumps(x, ensure_ascii=False)) for x in (response, items, own))
        if size > self.max_chars:
            return  # (one too big to keep: not at the cost of all the others)
        self.kept[response["id"]] = Stored(response, items, messages, size)
        self.chars += size
        while len(self.kept) > self.max_responses or self.chars > self.max_chars:
            self.chars -= self.kept.popitem(last=False)[1].size

    def delete(self, response_id: str) -> bool:
        stored = self.kept.pop(response_id, None)
        if stored is not None:
            self.chars -= stored.size
        return stored is not None


def _input_items(given: str | list[Any]) -> list[dict]:
    """A request's input as OpenAI lists it back: items, each with an id and a status, an assistant's text
    as output_text parts and the others' as input_text (the SDK's ResponseItem types)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    items = []
    for item in given:
        item = {"type": "message", **item} if "type" not in item else dict(item)
        if item["type"] == "message":
            content = item.get("content")
            texts = [content] if isinstance(content, str) else [p[_TEXT_PARTS[p["type"]]] for p in content]
            item["content"] = [{"type": "output_text", "text": t, "annotations": []} if item["role"] == "assistant"
                               else {"type": "input_text", "text": t} for t in texts]
        item.setdefault("id", _id({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                   "reasoning": "rs"}.get(item["type"], "item")))
        if item["type"] != "reasoning":
            item.setdefault("status", "completed")
        items.append(item)
    return items


def input_items_page(stored: Stored, limit: int, order: str, after: str | None) -> dict:
    """GET /v1/responses/{id}/input_items: a page of `limit` items in `order` (desc: newest first, OpenAI's
    default), after the item `after`; ValueError for an `after` not among them."""
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise ValueError(f"no input item {after!r} in this response")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


class ResponseBuilder(AnswerParts):
    """One response's output items as its answer comes (`add`: a chat delta's reasoning, content and
    tool-call entries), and the events a stream sends for them (`take`). A streamed response and a
    whole one are built alike."""
    THOUGHT, TEXT = "reasoning", "message"  # (the output items' types)

    def __init__(self, body: ResponsesRequest, model: str, store: ResponseStore | None = None,
                 previous: Stored | None = None):
        """store: where the finished response is kept, if its request asks (None: nowhere); previous: the
        response its previous_response_id names."""
        self.body, self.model, self.store, self.previous = body, model, store, previous
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict] = []
        self.open: dict | None = None  # the item text is going into (reasoning, message), if any
        self.calls: dict[int, dict] = {}  # tool-call entries' index -> their function_call item
        self.events: list[dict] = []
        self.sequence = 0
        self.reasoning_tokens = 0
        self._event("response.created", response=self.response("in_progress"))
        self._event("response.in_progress", response=self.response("in_progress"))

    def take(self) -> list[dict]:
        """The events since the last take."""
        out, self.events = self.events, []
        return out

    def _count(self, tokens: int, thinking: bool, cached_tokens: int | None) -> None:
        if thinking:  # (the usage at the end has the cached tokens)
            self.reasoning_tokens += tokens

    def _begin_call(self, index: int, call_id: str, name: str) -> None:
        self.calls[index] = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                             "call_id": call_id, "name": name, "arguments": ""}
        self._add_item(self.calls[index])

    def _arguments(self, index: int, piece: str) -> None:
        item = self.calls[index]
        if piece:
            item["arguments"] += piece
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=self.output.index(item), delta=piece)

    def finish(self, finish_reason: str | None, prompt_tokens: int, output_tokens: int, cached_tokens: int,
               stop_string: str | None = None) -> dict:
        """The whole response, once the answer has ended (its last event sent with it). Cut short by
        max_output_tokens, the item it was writing is incomplete, as the response is."""
        incomplete = finish_reason == "length"
        last = self.output[-1] if self.output and self.output[-1]["status"] == "in_progress" else None
        self._close("incomplete" if incomplete else "completed")
        for item in self.calls.values():
            self._done_call(item, "incomplete" if incomplete and item is last else "completed")
        self.calls = {}
        usage = {"input_tokens": prompt_tokens,
                 "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                 "total_tokens": prompt_tokens + output_tokens}
        status = "incomplete" if incomplete else "completed"
        response = self.response(status, usage)
        self._event(f"response.{status}", response=response)
        if self.store is not None:
            self.store.put(self.body, self.previous, response)
        return response

    def error(self, status: int, message: str, param: str | None = None, code: Any = None) -> None:
        """An error mid-stream: OpenAI's error event, and the response failed."""
        code = code or status
        self._event("error", code=str(code), message=message, param=param)
        response = self.response("failed")
        kind = "server_error" if str(code).startswith("5") else "rate_limit_exceeded" if str(code) == "429" else \
            "invalid_prompt"
        response["error"] = {"code": kind, "message": message}
        self._event("response.failed", response=response)

    def response(self, status: str, usage: dict | None = None) -> dict:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": copy.deepcopy(self.output) if status != "in_progress" else [],
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "tools": list(body.tools or []), "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "text": body.text or {"format": {"type": "text"}}, "reasoning": body.reasoning,
            "metadata": body.metadata or {}, "user": body.user,
            "store": bool(body.store and self.store is not None and self.store.max_responses), "background": False,
            "previous_response_id": body.previous_response_id, "truncation": "disabled", "usage": usage}

    # -- items and their events ------------------------------------------------------------

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def _add_item(self, item: dict) -> None:
        self.output.append(item)
        self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))

    def _text(self, kind: str, piece: str) -> None:
        """A piece of the thought (reasoning) or of the answer's text (message), into the open item of
        that kind or a new one."""
        if self.open is None or self.open["type"] != kind:
            self._close()
            part_kind = "reasoning_text" if kind == "reasoning" else "output_text"
            if kind == "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            else:
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
            self._add_item(item)
            part = {"type": part_kind, "text": ""} if kind == "reasoning" else \
                {"type": part_kind, "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                        content_index=0, part=dict(part))
            self.open = item
        part = self.open["content"][0]
        part["text"] += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        self._event(name, item_id=self.open["id"], output_index=self.output.index(self.open), content_index=0,
                    delta=piece, **extra)

    def _close(self, status: str = "completed") -> None:
        """The open text item is done (a call, the other kind of text or the end follows)."""
        item, self.open = self.open, None
        if item is None:
            return
        index, part = self.output.index(item), item["content"][0]
        item["status"] = status
        if item["type"] == "reasoning":
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"])
        else:
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
        self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                    part=dict(part))
        self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _done_call(self, item: dict, status: str) -> None:
        index = self.output.index(item)
        item["status"] = status
        self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    name=item["name"], arguments=item["arguments"])
        self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))
