"""Anthropic's Messages API's pieces (gateway/messages.py): a request as the chat request that answers
it, and a chat answer as content blocks and stream events. Through the gateway: tests/test_gateway.py."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.messages import MessageBuilder, MessagesError, MessagesRequest, chat_request


def _request(**fields) -> MessagesRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields},
                           type=MessagesRequest)


def test_a_request_becomes_the_chat_request_that_answers_it():
    chat = chat_request(_request(
        model="m", system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        max_tokens=9, temperature=0.5, top_p=0.9, top_k=4, stream=True, stop_sequences=["\n\n"],
        thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}, {"name": "g"}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "Hmm.", "signature": "x"},
                      {"type": "text", "text": "Checking."},
                      {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Paris"}},
                      {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                      {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "3"}]},
                      {"type": "text", "text": "Thanks."}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3"}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t4", "is_error": True,
                                                "content": "city not found"},
                                               {"type": "tool_result", "tool_use_id": "t5", "is_error": True}]}]))
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
            {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "3"},
        {"role": "user", "content": "Thanks."},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
        {"role": "tool", "tool_call_id": "t4", "content": "Error: city not found"},  # (is_error: said to the model)
        {"role": "tool", "tool_call_id": "t5", "content": "Error"}]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "d"}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert chat["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True}
    assert (chat["max_completion_tokens"], chat["temperature"], chat["top_p"], chat["top_k"], chat["stop"],
            chat["stream"], chat["model"]) == (9, 0.5, 0.9, 4, ["\n\n"], True, "m")
    assert chat_request(_request(tool_choice={"type": "tool", "name": "f"}))["tool_choice"] == {
        "type": "function", "function": {"name": "f"}}
    assert chat_request(_request(thinking={"type": "disabled"}))["chat_template_kwargs"]["enable_thinking"] is False
    config = chat_request(_request(output_config={"effort": "low", "format": {"type": "json_schema", "schema": {
        "type": "object"}}}))
    assert config["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert config["response_format"] == {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object"}}}
    assert "chat_template_kwargs" not in chat_request(_request())
    prefill = chat_request(_request(messages=[{"role": "user", "content": "JSON?"}, {"role": "assistant", "content": "{"}]))
    assert (prefill["continue_final_message"], prefill["add_generation_prompt"]) == (True, False)
    for empty in ("", []):  # (Anthropic allows an empty last assistant message: no prefill, a plain answer)
        plain = chat_request(_request(messages=[{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                    "content": empty}]))
        assert plain["messages"] == [{"role": "user", "content": "hi"}] and "continue_final_message" not in plain
    assert "continue_final_message" not in chat  # (a conversation that ends with a tool's result)


@pytest.mark.parametrize("fields, param", [
    ({"container": "c"}, "container"), ({"mcp_servers": []}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"), ({"thinking": {"type": "deep"}}, "thinking"),
    ({"output_config": {"format": {"type": "yaml"}}}, "output_config"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]}, "messages"),
    *(({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": given}]}]},
       "messages") for given in ("x", [1])),  # (Anthropic's input is an object)
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " \n"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages"),
    ({"system": [{"type": "image"}]}, "system"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     "messages"),
])
def test_what_cannot_be_served_is_an_error_naming_its_field(fields, param):
    with pytest.raises(MessagesError) as e:
        chat_request(_request(**fields))
    assert e.value.param == param


def test_an_answer_becomes_content_blocks_in_the_order_it_came_with_their_events():
    b = MessageBuilder("m", prompt_tokens=7)
    b.add({"reasoning": "Hmm"}, cached_tokens=4)  # (the first tokens say what the prefix cache held)
    b.add({"reasoning": ", yes."})
    b.add({"content": "Sure"})
    b.add({"content": "."})
    b.add({"tool_calls": [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                          {"index": 1, "id": "b", "type": "function",
                           "function": {"name": "g", "arguments": '{"x": 1}'}}]})
    message = b.finish("stop", 7, output_tokens=5, cached_tokens=4)
    events = b.take()
    assert message["content"] == [{"type": "thinking", "thinking": "Hmm, yes.", "signature": ""},
                                  {"type": "text", "text": "Sure."},
                                  {"type": "tool_use", "id": "a", "name": "f", "input": {}},
                                  {"type": "tool_use", "id": "b", "name": "g", "input": {"x": 1}}]
    assert (message["stop_reason"], message["stop_sequence"], message["role"], message["type"]) == (
        "tool_use", None, "assistant", "message")
    assert message["usage"] == {"input_tokens": 3, "output_tokens": 5, "cache_read_input_tokens": 4,
                                "cache_creation_input_tokens": 0}
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    assert events[0]["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0, "cache_read_input_tokens": 4,
                                             "cache_creation_input_tokens": 0}  # (as the end's usage splits them)
    # blocks one after the other: each starts, takes its deltas and stops before the next starts
    order = [(e["type"], e["index"]) for e in events if "index" in e]
    opened = [i for kind, i in order if kind == "content_block_start"]
    assert opened == [0, 1, 2, 3]
    for i in opened:
        at = [k for k, (_, j) in enumerate(order) if j == i]
        assert at == list(range(at[0], at[-1] + 1))
        assert order[at[0]][0] == "content_block_start" and order[at[-1]][0] == "content_block_stop"
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == [{"type": "thinking_delta", "thinking": "Hmm"}, {"type": "thinking_delta", "thinking": ", yes."},
                      {"type": "text_delta", "text": "Sure"}, {"type": "text_delta", "text": "."},
                      {"type": "input_json_delta", "partial_json": "{}"},
                      {"type": "input_json_delta", "partial_json": '{"x": 1}'}]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 5


@pytest.mark.parametrize("finish, stop, call, capped, want", [
    ("length", None, False, False, "max_tokens"), ("length", None, False, True, "model_context_window_exceeded"),
    ("stop", "\n\n", False, False, "stop_sequence"), ("stop", "END", True, False, "stop_sequence"),
    ("stop", None, True, False, "tool_use"), ("stop", None, False, False, "end_turn")])
def test_the_stop_reason_says_why_the_answer_ended(finish, stop, call, capped, want):
    b = MessageBuilder("m", 3, capped=capped)
    b.add({"content": "Hi"})
    if call:
        b.add({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    message = b.finish(finish, 3, 1, 0, stop)
    named = stop if want == "stop_sequence" else None  # (a stop sequence is named only where it is the reason)
    assert (message["stop_reason"], message["stop_sequence"]) == (want, named)
    assert b.take()[-2]["delta"] == {"stop_reason": want, "stop_sequence": named}


def test_blocks_alike_are_told_apart_and_a_calls_leading_whitespace_waits():
    b = MessageBuilder("m", 3)
    b.add({"reasoning": "a"})
    b.add({"content": "b"})
    b.add({"reasoning": "a"})  # (a second thought, equal to the first: its own block)
    b.add({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": " "}}]})
    b.add({"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]})
    b.add({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    message = b.finish("stop", 3, 6, 0)
    events = b.take()
    assert [(e["type"], e.get("index")) for e in events if e["type"].startswith("content_block_st")] == [
        ("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_stop", 3)]
    assert [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"] == [
        '{"x"', ": 1}"]
    assert message["content"][3]["input"] == {"x": 1}


def test_a_named_call_streams_its_input_and_a_cut_one_has_what_is_whole_of_it():
    b = MessageBuilder("m", 3)
    b.add({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a'}}]})
    b.add({"tool_calls": [{"index": 0, "function": {"arguments": '": 1'}}]})
    message = b.finish("length", 3, 3, 0)
    assert message["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]
    assert message["stop_reason"] == "max_tokens"
    partial = "".join(e["delta"]["partial_json"] for e in b.take() if e["type"] == "content_block_delta")
    assert partial == '{"a": 1'
    assert json.loads(partial + "}") == {"a": 1}


def test_a_tool_use_whose_arguments_nest_past_the_parser_is_an_empty_input():
    from gateway.messages import _input

    assert _input('{"a": ' + "[" * 5000) == {} and _input('{"a": 1}') == {"a": 1}


def test_a_tool_use_cut_short_reads_as_anthropics_sdk_reads_its_stream():
    """max_tokens cutting a tool_use's arguments: the whole message's input is what Anthropic's SDK makes
    of the streamed input_json_deltas (jiter's partial mode over their concatenation: what is whole of
    them), not {}; the deltas carry the arguments as written."""
    for arguments, want in (('{"a" : 30,', {"a": 30}), ('{"city": "Os', {}), ('{"a": [1, {"b": tr', {"a": [1, {}]}),
                            ('{"a": 1}', {"a": 1}), ("[1, 2", {}), ('{"x": NaN}', {})):
        b = MessageBuilder("m", 3)
        b.add({"tool_calls": [{"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": ""}}]})
        for piece in (arguments[:4], arguments[4:]):
            b.add({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        whole = b.finish("length", 3, 5, 0)
        streamed = "".join(e["delta"]["partial_json"] for e in b.take() if e["type"] == "content_block_delta")
        assert streamed == arguments and whole["content"][0]["input"] == want, arguments
