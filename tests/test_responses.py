"""The Responses API's pieces (gateway/responses.py): a request as the chat request that answers it, and
a chat answer as output items and stream events. Through the gateway and the mesh: tests/test_gateway.py."""

from __future__ import annotations

import msgspec
import pytest

from gateway.responses import (ResponseBuilder, ResponsesError, ResponsesRequest, ResponseStore, chat_request,
                                input_items_page)


def _request(**fields) -> ResponsesRequest:
    return msgspec.convert({"input": "hi", **fields}, type=ResponsesRequest)


def test_a_request_becomes_the_chat_request_that_answers_it():
    chat = chat_request(_request(
        model="m", instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_p=0.9, stream=True,
        parallel_tool_calls=False, reasoning={"effort": "low"},
        tools=[{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True}},
        input=[{"role": "developer", "content": "Rules."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                                               {"type": "input_text", "text": "Now."}]},
               {"type": "reasoning", "id": "rs_1", "summary": []},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
               {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
               {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"x": 1}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
               {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "3"}]},
               {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]))
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Rules."},  # (developer: the system's role for a chat template)
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Now."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [  # (one turn)
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "3"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert (chat["max_completion_tokens"], chat["temperature"], chat["top_p"], chat["stream"],
            chat["parallel_tool_calls"], chat["model"]) == (9, 0.5, 0.9, True, False, "m")
    assert chat_request(_request())["messages"] == [{"role": "user", "content": "hi"}]
    assert chat_request(_request(text={"format": {"type": "text"}}))["response_format"] == {"type": "text"}


@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"), ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"conversation": "conv_1"}, "conversation"), ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema"}}}, "text"), ({"input": [5]}, "input"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # (no call_id)
    ({"input": [{"type": "computer_call_output"}]}, "input"),
    ({"reasoning": {"effort": 5}}, "reasoning"), ({"reasoning": {"effort": ""}}, "reasoning"),
])
def test_what_cannot_be_served_is_an_error_naming_its_field(fields, param):
    with pytest.raises(ResponsesError) as e:
        chat_request(_request(**fields))
    assert e.value.param == param


def test_an_answer_becomes_output_items_in_the_order_it_came_with_their_events():
    b = ResponseBuilder(_request(), "m")
    b.add({"reasoning": "Hmm", "reasoning_content": "Hmm"}, 1, True)
    b.add({"reasoning": ", yes.", "reasoning_content": ", yes."}, 2, True)
    b.add({"content": "Sure"}, 1)
    b.add({"content": "."}, 1)
    b.add({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                          {"index": 1, "id": "call_b", "type": "function",
                           "function": {"name": "g", "arguments": '{"x": 1}'}}]}, 0)
    response = b.finish("stop", prompt_tokens=7, output_tokens=5, cached_tokens=4)
    events = b.take()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call", "function_call"]
    rs, msg, fa, fb = response["output"]
    assert rs["content"] == [{"type": "reasoning_text", "text": "Hmm, yes."}] and rs["status"] == "completed"
    assert msg["content"][0]["text"] == "Sure." and msg["role"] == "assistant" and msg["status"] == "completed"
    assert (fa["call_id"], fa["name"], fa["arguments"], fb["call_id"], fb["arguments"]) == (
        "call_a", "f", "{}", "call_b", '{"x": 1}')
    assert response["status"] == "completed" and response["incomplete_details"] is None
    assert response["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                                 "output_tokens": 5,
                                 "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 12}
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0]["response"]["output"] == [] and events[-1]["response"] == response
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["id"] for a in added] == [item["id"] for item in response["output"]]
    assert added[0]["content"] == [] and added[1]["content"] == []  # (as they were when added: empty)
    assert [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"] == ["Hmm", ", yes."]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Sure", "."]
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert [done[i] for i in range(4)] == response["output"]
    # every item opens before its deltas and closes after them
    for i, item in enumerate(response["output"]):
        at = [k for k, e in enumerate(events) if e.get("output_index") == i]
        assert events[at[0]]["type"] == "response.output_item.added"
        assert events[at[-1]]["type"] == "response.output_item.done"


def test_a_named_call_streams_its_arguments_and_a_cut_answer_is_incomplete():
    b = ResponseBuilder(_request(max_output_tokens=3), "m")
    b.take()
    b.add({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a'}}]}, 1)
    b.add({"tool_calls": [{"index": 0, "function": {"arguments": '": 1'}}]}, 2)
    assert [e["delta"] for e in b.take() if e["type"] == "response.function_call_arguments.delta"] == ['{"a', '": 1']
    response = b.finish("length", 5, 3, 0)
    (call,) = response["output"]
    assert call["arguments"] == '{"a": 1' and response["status"] == "incomplete" and call["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"} and response["max_output_tokens"] == 3
    assert b.take()[-1]["type"] == "response.incomplete"
    cut = ResponseBuilder(_request(), "m")
    cut.add({"reasoning": "Hmm"}, 1, True)
    cut.add({"content": "Par"}, 1)
    assert [item["status"] for item in cut.finish("length", 5, 2, 0)["output"]] == ["completed", "incomplete"]


def test_an_error_mid_stream_fails_the_response():
    b = ResponseBuilder(_request(), "m")
    b.add({"content": "Hi"}, 1)
    b.error(503, "the coordinator restarted")
    error, failed = b.take()[-2:]
    assert (error["type"], error["code"], error["message"]) == ("error", "503", "the coordinator restarted")
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the coordinator restarted"}


def test_responses_and_events_are_the_openai_sdks_types():
    """Every event and response the builder makes validates against the openai SDK's own models."""
    openai = pytest.importorskip("openai")
    from pydantic import TypeAdapter

    events = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    for finish in ("stop", "length"):
        b = ResponseBuilder(_request(tools=[tool], tool_choice="auto", reasoning={"effort": "low"},
                                     text={"format": {"type": "text"}}, metadata={"k": "v"}), "m")
        b.add({"reasoning": "Hmm"}, 1, True)
        b.add({"content": "Sure."}, 1)
        b.add({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
        openai.types.responses.Response.model_validate(b.finish(finish, 3, 2, 1))
        for event in b.take():
            events.validate_python(event)
    b = ResponseBuilder(_request(), "m")
    b.error(500, "boom")
    for event in b.take():
        events.validate_python(event)


# -- kept responses ---------------------------------------------------------------------------------

def _answered(kept_in: ResponseStore | None, text: str, previous=None, **fields) -> dict:
    """A response to `fields` whose answer is `text`, kept in `kept_in` as the gateway keeps it."""
    body = _request(**fields)
    builder = ResponseBuilder(body, "m", kept_in, previous)
    builder.add({"content": text}, 2, False, 0)
    return builder.finish("stop", 5, 2, 0)


def test_a_kept_response_is_continued_as_its_whole_conversation():
    store = ResponseStore(8)
    first = _answered(store, "Red.", input="Name a colour.", instructions="Be brief.")
    assert first["store"] is True and first["previous_response_id"] is None
    kept = store.get(first["id"])
    assert kept.response == first
    assert kept.messages == [{"role": "user", "content": "Name a colour."},
                             {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]
    body = _request(input=[{"role": "user", "content": "Another?"}], previous_response_id=first["id"],
                    instructions="Be terse.")
    # (the earlier instructions are not carried over, as OpenAI's are not)
    assert chat_request(body, kept)["messages"] == [{"role": "system", "content": "Be terse."}, *kept.messages,
                                                    {"role": "user", "content": "Another?"}]
    second = _answered(store, "Blue.", kept, input=[{"role": "user", "content": "Another?"}],
                       previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    assert store.get(second["id"]).messages == [*kept.messages, {"role": "user", "content": "Another?"},
                                                {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}]


def test_the_store_keeps_the_newest_within_its_bounds_and_what_asks_to_be_kept():
    store = ResponseStore(2)
    ids = [_answered(store, f"a{i}", input=f"q{i}")["id"] for i in range(3)]
    assert [store.get(i) is not None for i in ids] == [False, True, True]
    unkept = _answered(store, "x", input="q", store=False)
    assert unkept["store"] is False and store.get(unkept["id"]) is None
    assert _answered(ResponseStore(0), "x", input="q")["store"] is False
    assert _answered(None, "x", input="q")["store"] is False
    small = ResponseStore(8, max_chars=3000)
    ids = [_answered(small, "a" * 300, input="q" * 300)["id"] for _ in range(4)]
    assert small.chars <= 3000 and small.get(ids[-1]) is not None and small.get(ids[0]) is None
    assert store.delete(ids[-1]) is False  # (kept in the other store)
    newest = next(reversed(store.kept))
    assert store.delete(newest) is True and store.get(newest) is None and store.delete(newest) is False


def test_input_items_come_back_with_ids_a_page_at_a_time():
    store = ResponseStore(8)
    r = _answered(store, "ok", input=[{"role": "user", "content": "one"},
                                     {"type": "message", "role": "assistant", "content": "two"},
                                     {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                     {"type": "function_call_output", "call_id": "c", "output": "three"}])
    kept = store.get(r["id"])
    assert [i["type"] for i in kept.input_items] == ["message", "message", "function_call", "function_call_output"]
    assert kept.input_items[0]["content"] == [{"type": "input_text", "text": "one"}]
    assert all(i["id"] for i in kept.input_items) and len({i["id"] for i in kept.input_items}) == 4
    page = input_items_page(kept, 3, "desc", None)  # (newest first, OpenAI's default)
    assert [i["type"] for i in page["data"]] == ["function_call_output", "function_call", "message"]
    assert page["has_more"] and page["last_id"] == kept.input_items[1]["id"]
    rest = input_items_page(kept, 3, "desc", page["last_id"])
    assert rest["data"] == [kept.input_items[0]] and not rest["has_more"]
    assert input_items_page(kept, 20, "asc", None)["data"] == kept.input_items
    with pytest.raises(ValueError, match="no input item"):
        input_items_page(kept, 3, "asc", "msg_nope")


def test_kept_input_items_are_the_openai_sdks_types():
    import pydantic
    from openai.types.responses import ResponseItem

    store = ResponseStore(8)
    r = _answered(store, "ok", input=[
        {"role": "user", "content": "one"}, {"role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {"type": "message", "role": "assistant", "content": "two"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "three"}]},
        {"role": "user", "content": [{"type": "text", "text": "four"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "five"}])
    kept = store.get(r["id"]).input_items
    adapter = pydantic.TypeAdapter(ResponseItem)
    for item in kept:
        adapter.validate_python(item, strict=False)
    assert [i["content"][0]["type"] for i in kept[:5]] == ["input_text", "input_text", "output_text", "output_text",
                                                           "input_text"]
    assert _answered(store, "ok", input="hi") and store.get(next(reversed(store.kept))).input_items[0]["content"] == \
        [{"type": "input_text", "text": "hi"}]


def test_a_chain_counts_each_responses_own_part_against_the_bound():
    store = ResponseStore(1000, max_chars=200_000)
    previous = None
    for i in range(60):  # (a chain of 60 turns of ~1,000 characters: ~120,000 in all, each turn counted once)
        r = _answered(store, "b" * 500, previous, input="a" * 500,
                      **({"previous_response_id": previous.response["id"]} if previous else {}))
        previous = store.get(r["id"])
    assert len(store.kept) == 60 and store.chars < 200_000
