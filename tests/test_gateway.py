"""The OpenAI-compatible gateway through `moemesh serve`: the official openai client, raw HTTP for
the error cases, disconnects, tokenizer endpoints and metrics."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest

from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parent.parent
SPEC = TinyModelSpec(arch="mixtral", num_layers=2, hidden_size=64, intermediate_size=64, num_experts=4,
                     vocab_size=600, max_position_embeddings=256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moemesh", "serve", "--model", str(model), "--port", str(self.port),
             "--kv-memory", str(4 << 20), *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()
            try:
                if http("GET", f"{self.url}/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("server did not come up")

    def stop(self) -> tuple[bytes, bytes]:
        """Stops it (Ctrl-C); its (stdout, stderr)."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.communicate(timeout=30)


def http(method: str, url: str, body=None, headers=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(SPEC, tmp_path_factory.mktemp("gw") / "tiny-mixtral")


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--pp", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server, model):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    c.model_dir = model
    return c


def engine_greedy(model, prompt_ids, n, **params):
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings
    from moemesh.sampling import SamplingParams

    engine = LLMEngine(EngineSettings(model=str(model), num_kv_blocks=64), progress=False)
    return engine.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                        **params))[0].token_ids


def test_completion_matches_the_engine_streaming_or_not(model, client):
    from moemesh.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    prompt = "The quick brown fox"
    want = tok.decode(engine_greedy(model, tok.encode(prompt), 12))
    r = client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_chat_greedy_equals_transformers_through_the_same_template(model, client):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    hf_tok = AutoTokenizer.from_pretrained(model)
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    status, body, _ = http("POST", client.base_url.__str__().replace("/v1/", "/tokenize"), {"messages": messages})
    assert status == 200 and json.loads(body)["tokens"] == ids
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    want = hf_tok.decode(out[0, len(ids):], skip_special_tokens=True)
    r = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_stop_strings_n_seed_and_logprobs(model, client):
    base = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    assert stop and stop in base
    cut = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == base[:base.index(stop)] and cut.finish_reason == "stop"
    streamed = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=16, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut.text

    kw = dict(model="tiny-mixtral", prompt="Once upon", max_tokens=8, temperature=1.0, n=2, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text and [c.index for c in a.choices] == [0, 1]

    lp = client.completions.create(model="tiny-mixtral", prompt=[[5, 6, 7, 8]], max_tokens=1, temperature=0,
                                   echo=True, logprobs=1).choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and lp.token_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:])
    # the top one, and the position's own token where that is not it (OpenAI: up to logprobs + 1)
    assert all(t in top and 1 <= len(top) <= 2 for t, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    chat = client.chat.completions.create(model="tiny-mixtral", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_errors_in_openai_shape(server):
    url = f"{server.url}/v1/completions"
    cases = [
        (http("POST", url, raw=b"{not json"), 400, None),
        (http("POST", url, {"prompt": "x", "max_tokens": "many"}), 400, "max_tokens"),
        (http("POST", url, {"prompt": "x", "temperature": -1}), 400, "temperature"),
        (http("POST", url, {"prompt": "x", "max_tokens": 300}), 400, "max_tokens"),
        (http("POST", url, {"prompt": [1, 99999]}), 400, "prompt"),
        (http("POST", url, {"prompt": "x", "model": "gpt-9"}), 404, "model"),
        (http("POST", url, raw=b'{"prompt": "' + b"a" * (9 << 20) + b'"}'), 413, None),
        (http("POST", f"{server.url}/v1/chat/completions", {"messages": "hi"}), 400, "messages"),
        (http("POST", url, {"prompt": "x", "stream": True, "stop_token_ids": [-5]}), 400, "stop_token_ids"),
        (http("POST", url, {"max_tokens": 2}), 400, "prompt"),  # (a required field left out is named)
        (http("POST", f"{server.url}/v1/chat/completions", {}), 400, "messages"),
        (http("POST", url, {"prompt": "x", "seed": 1 << 64}), 400, "seed"),
        # a body that does not decompress as its Content-Encoding says, or ends early; one past the limit
        # once decompressed; codings the gateway does not decode (aiohttp would answer some in plain
        # text, and take others as if the body were not encoded)
        (http("POST", url, raw=b"not gzip at all", headers={"Content-Encoding": "gzip"}), 400, None),
        (http("POST", url, raw=gzip.compress(b'{"prompt": "x"}')[:-6], headers={"Content-Encoding": "gzip"}), 400,
         None),
        (http("POST", url, raw=gzip.compress(b'{"prompt": "' + b"a" * (9 << 20) + b'"}'),
              headers={"Content-Encoding": "gzip"}), 413, None),
        (http("POST", url, raw=b'{"prompt": "x"}', headers={"Content-Encoding": "br"}), 415, None),
        (http("POST", url, raw=b'{"prompt": "x"}', headers={"Content-Encoding": "x-custom"}), 415, None),
        (http("POST", url, raw=gzip.compress(b'{"prompt": "x"}'), headers={"Content-Encoding": "gzip, zstd"}), 415,
         None),
        # past what any client sends: each costs a pass over the body (thousands of empty gzip members
        # made the event loop's work grow with their square)
        (http("POST", url, raw=gzip.compress(b"") * 17 + gzip.compress(b'{"prompt": "x"}'),
              headers={"Content-Encoding": "gzip"}), 400, None),
        (http("POST", url, raw=gzip.compress(gzip.compress(gzip.compress(b'{"prompt": "x"}'))),
              headers={"Content-Encoding": "gzip, gzip, gzip"}), 400, None),
        (http("POST", url, raw=zlib.compress(b'{"prompt": "x"}') + b"tail", headers={"Content-Encoding": "deflate"}),
         400, None),
    ]
    context = [  # (past the context: OpenAI's code for it, and the field that is too long)
        (http("POST", url, {"prompt": "x", "max_tokens": 300}), "max_tokens"),
        (http("POST", url, {"prompt": [91] * 256, "max_tokens": None}), "prompt"),
        (http("POST", url, {"prompt": [91] * 300}), "prompt"),
        (http("POST", f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}),
         "messages"),
    ]
    for (status, body, _), want_status, want_param in cases + [(r, 400, p) for r, p in context]:
        assert status == want_status, body
        err = json.loads(body)["error"]
        want_code = "context_length_exceeded" if want_param in ("prompt", "messages", "max_tokens") and (
            "context length" in err["message"]) else want_status
        assert err["message"] and err["code"] == want_code and err["param"] == want_param, err
    assert [json.loads(r[1])["error"]["code"] for r, _ in context] == ["context_length_exceeded"] * len(context)
    status, body, _ = http("POST", url, {"prompt": "x", "max_tokens": 300})
    assert "256" in json.loads(body)["error"]["message"] and "301" in json.loads(body)["error"]["message"]
    message = json.loads(context[1][0][1])["error"]["message"]
    assert "256" in message and "max_tokens" not in message  # (the prompt's fault, not a field it never sent)


def test_compressed_request_bodies(server):
    """gzip (also in several members, and twice over), deflate in the zlib format and raw, identity:
    each gives the answer of the plain body; an unsupported coding's 415 names the ones taken."""
    url = f"{server.url}/v1/completions"
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}).encode()
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    encoded = [
        ({}, body),
        ({"Content-Encoding": "identity"}, body),
        ({"Content-Encoding": "gzip"}, gzip.compress(body)),
        ({"Content-Encoding": "x-gzip"}, gzip.compress(body[:9]) + gzip.compress(body[9:])),
        ({"Content-Encoding": "GZIP, gzip"}, gzip.compress(gzip.compress(body))),
        ({"Content-Encoding": "deflate"}, zlib.compress(body)),
        ({"Content-Encoding": "deflate"}, raw_deflate.compress(body) + raw_deflate.flush()),
    ]
    texts = []
    for headers, data in encoded:
        status, reply, _ = http("POST", url, raw=data, headers=headers)
        assert status == 200, (headers, reply)
        texts.append(json.loads(reply)["choices"][0]["text"])
    assert len(set(texts)) == 1
    status, _, headers = http("POST", url, raw=body, headers={"Content-Encoding": "br"})
    assert status == 415 and headers["Accept-Encoding"] == "gzip, deflate"


def test_a_lone_surrogate_escape_is_named_not_called_truncated_json():
    """msgspec reads on after a high surrogate's escape for the low one and, finding none, says the input
    was truncated: the 400 says what is wrong instead; an escaped backslash before "ud800" is text."""
    import msgspec

    from gateway.server import _decode_error

    def message(raw: bytes) -> str:
        with pytest.raises(msgspec.DecodeError) as e:
            msgspec.json.decode(raw)
        return _decode_error(raw, e.value)

    assert "\\ud800 with no low surrogate after it, byte 12" in message(b'{"prompt": "\\ud800"}')
    assert "\\uDBFF with no low surrogate" in message(b'{"prompt": "a\\\\\\uDBFFx"}')
    assert message(b'{"prompt": "\\\\ud800') == "Input data was truncated"  # (text, then truly cut short)
    assert message(b'{"prompt": "\\ud800\\udc00') == "Input data was truncated"  # (a pair)


def test_each_api_names_its_own_fields_and_answers_in_its_own_shape(server):
    """A 400 from a check the chat request makes names the field as the API the client used names it,
    in the message as in param; /v1/messages' 404s and 405s are Anthropic's shape; the tokenizer
    routes know their model, as the rest do."""
    status, body, _ = http("POST", f"{server.url}/v1/responses", {"input": "hi", "max_output_tokens": 0})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "max_output_tokens", body
    assert error["message"].startswith("max_output_tokens ") and "max_completion_tokens" not in error["message"]
    status, body, _ = http("POST", f"{server.url}/v1/messages", {
        "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]})
    assert status == 400 and json.loads(body)["error"]["message"].startswith("stop_sequences takes"), body
    status, body, _ = http("POST", f"{server.url}/v1/messages", {
        "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]})
    assert status == 400 and "prefill" in json.loads(body)["error"]["message"], body
    for method, path, code in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/batches", 404)):
        status, body, _ = http(method, f"{server.url}{path}", {} if method == "POST" else None)
        assert status == code and json.loads(body)["type"] == "error", (path, body)  # (Anthropic's)
    for path, body in (("/tokenize", {"prompt": "x", "model": "nope"}), ("/detokenize", {"tokens": [5], "model": "nope"})):
        status, answer, _ = http("POST", f"{server.url}{path}", body)
        assert status == 404 and json.loads(answer)["error"]["param"] == "model", (path, answer)
    assert http("POST", f"{server.url}/tokenize", {"prompt": "x", "model": "tiny-mixtral"})[0] == 200


def test_more_bad_input_is_a_400_not_a_500_or_a_retry(server):
    """Reserved chat_template_kwargs, a non-string text part, top_logprobs without logprobs, more
    sequences than the server ever takes (a 429 would be retried forever), text too long for any
    context (refused before it is tokenized), and unsupported options that would change the answer."""
    chat = f"{server.url}/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (http("POST", chat, {"messages": user, "chat_template_kwargs": {"messages": []}}), "chat_template_kwargs"),
        (http("POST", chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}), "messages"),
        (http("POST", chat, {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "a"}]}]}),
         "messages"),
        (http("POST", f"{server.url}/tokenize", {"messages": [{"role": "user", "content": [{"type": {"a": 1}}]}]}),
         "messages"),
        (http("POST", chat, {"messages": user, "max_completion_tokens": 300}), "max_completion_tokens"),
        (http("POST", f"{server.url}/tokenize", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
         "messages"),
        (http("POST", chat, {"messages": user, "top_logprobs": 2}), "top_logprobs"),
        # an earlier call that is not OpenAI's shape (it would reach the template as it came)
        *((http("POST", chat, {"messages": [*user, {"role": "assistant", "tool_calls": calls}]}), "messages")
          for calls in ("x", ["x"], [{"id": "a"}], [{"id": "a", "type": "function",
                                                     "function": {"name": "f", "arguments": 5}}])),
        # (arguments as an object, or left out, are taken, as vLLM takes them: below)
        (http("POST", f"{server.url}/v1/completions", {"prompt": ["x"] * 256, "n": 16, "max_tokens": 1}), "n"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "word " * 200_000}), "prompt"),
        (http("POST", f"{server.url}/tokenize", {"prompt": "word " * 200_000}), "prompt"),
        (http("POST", chat, {"messages": [{"role": "user", "content": "word " * 200_000}]}), "messages"),
        (http("POST", chat, {"messages": user, "max_completion_tokens": 0}), "max_completion_tokens"),
        # what would change the answer and is not supported is refused, not ignored
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "suffix": "end"}), "suffix"),
        # biases and token sets that name no token of the model, or are out of range
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}), "logit_bias"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "logit_bias": {"5": 100.5}}), "logit_bias"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}), "logit_bias"),
        (http("POST", chat, {"messages": user, "logit_bias": {"-5": 1}}), "logit_bias"),
        (http("POST", chat, {"messages": user, "logit_bias": {"\u00b2": 1}}), "logit_bias"),  # (a digit to isdigit)
        (http("POST", chat, {"messages": user, "logit_bias": {"1" * 5000: 1}}), "logit_bias"),
        (http("POST", chat, {"messages": user, "logit_bias": {"5": "up"}}), "logit_bias[...]"),  # (msgspec's path)
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "allowed_token_ids": []}), "allowed_token_ids"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "allowed_token_ids": [5, 99999]}),
         "allowed_token_ids"),
        # (tool_choice auto, the default with tools, needs --tool-call-parser)
        (http("POST", chat, {"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]}),
         "tool_choice"),
        # a structured output that cannot be had, or two at once
        (http("POST", chat, {"messages": user, "response_format": {"type": "json_schema"}}), "response_format"),
        (http("POST", chat, {"messages": user, "guided_regex": "[a-"}), "guided_regex"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "guided_choice": ["a"], "guided_regex": "a"}),
         "guided_regex"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "structured_outputs": {"structural_tag": "x"}}),
         "structured_outputs"),
        # and so are vLLM's extra parameters that this server does not have
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "bad_words": ["  "]}), "bad_words"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "bad_words": ["x" * 300]}), "bad_words"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "bad_words": ["a"] * 257}), "bad_words"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "best_of": 2}), "best_of"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "spaces_between_special_tokens": False}),
         "spaces_between_special_tokens"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}),
         "truncate_prompt_tokens"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}),
         "stream_options"),
        (http("POST", f"{server.url}/v1/completions", {"prompt": "x", "stream": True, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}), "stream_options"),  # (ignored, it had been)
    ]
    for (status, body, _), want_param in cases:
        assert status == 400, body
        assert json.loads(body)["error"]["param"] == want_param, body
    status, body, _ = http("GET", f"{server.url}/v1/completions")
    assert status == 405 and json.loads(body)["error"]["type"] == "invalid_request_error"
    # add_generation_prompt may come in chat_template_kwargs (as vLLM takes it)
    for ok in [{"chat_template_kwargs": {"add_generation_prompt": False}}, {"logit_bias": {}}, {"bad_words": []},
               {"stream_options": {}},
               {"spaces_between_special_tokens": True},
               {"response_format": {"type": "text"}},
               {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}]:
        status, body, _ = http("POST", chat, {"messages": user, "max_tokens": 2, **ok})
        assert status == 200, (ok, body)
    # an earlier call's arguments as an object, or left out (vLLM takes both)
    for fn in ({"name": "f", "arguments": {"a": 1}}, {"name": "f"}):
        earlier = [*user, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": fn}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "3"}]
        status, body, _ = http("POST", chat, {"messages": earlier, "max_tokens": 2})
        assert status == 200, (fn, body)
    # what OpenAI's API and vLLM take: null for a field with a default (the default), top_k -1 (off), any
    # 64-bit seed
    completions = f"{server.url}/v1/completions"
    for ok in [{"n": None, "stream": None, "echo": None, "min_tokens": None, "include_stop_str_in_output": None},
               {"top_k": -1}, {"seed": -1, "temperature": 1.0}, {"seed": (1 << 64) - 1, "temperature": 1.0}]:
        status, body, _ = http("POST", completions, {"prompt": "x", "max_tokens": 2, "ignore_eos": True, **ok})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2, (ok, body)
        assert len(json.loads(body)["choices"]) == 1
    # seed -1 is no seed (vLLM's reading): draws differ; a seed repeats
    def drawn(seed):
        body = http("POST", completions, {"prompt": "x", "max_tokens": 8, "ignore_eos": True, "temperature": 1.0,
                                          "seed": seed})[1]
        return json.loads(body)["choices"][0]["text"]

    assert len({drawn(-1) for _ in range(3)}) > 1 and drawn(7) == drawn(7)
    status, body, _ = http("POST", completions, {"prompt": "x", "max_tokens": 2, "ignore_eos": None})
    assert status == 200, body  # (null: the default, false)
    status, body, _ = http("POST", completions, raw=b'{"prompt": "x", "temperature": 1e400}')
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature", body
    status, body, _ = http("POST", chat, {"messages": user, "max_tokens": 2, "logprobs": None, "n": None})
    assert status == 200 and json.loads(body)["choices"][0]["logprobs"] is None, body
    assert http("GET", f"{server.url}/v1/models/tiny-mixtral")[0] == 200
    status, body, _ = http("GET", f"{server.url}/v1/models/org/gpt-9")  # (a name with a slash reaches the handler)
    assert status == 404 and json.loads(body)["error"]["param"] == "model"


def test_structured_outputs_through_the_api_as_the_engine_gives_them(model, server, client):
    """response_format (chat) and vLLM's structured_outputs and guided_choice (completions, streamed
    or not) through the pp=2 mesh: the in-process engine's tokens under the same grammar, and text
    that the constraint accepts."""
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.sampling import SamplingParams
    from moemesh.settings import EngineSettings
    from moemesh.structured import grammar_of
    from moemesh.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    engine = LLMEngine(EngineSettings(model=str(model), num_kv_blocks=64), progress=False)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    messages = [{"role": "user", "content": "Pick a colour."}]
    r = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=30, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "pick", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    assert answer["colour"] in ("red", "green", "blue") and 0 <= answer["n"] <= 9 and set(answer) == {"colour", "n"}
    assert r.choices[0].finish_reason == "stop"
    ids = json.loads(http("POST", f"{server.url}/tokenize", {"messages": messages})[1])["tokens"]
    grammar = grammar_of({"guided_json": schema})
    assert r.choices[0].message.content == tok.decode(
        engine.generate([ids], SamplingParams(max_tokens=30, temperature=0, grammar=grammar))[0].token_ids)
    for fields in ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, {"guided_choice": ["alpha", "beta", "gamma"]}):
        want = tok.decode(engine.generate([tok.encode("Once upon")], SamplingParams(
            max_tokens=20, temperature=0, grammar=grammar_of(fields)))[0].token_ids)
        r = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=20, temperature=0,
                                      extra_body=fields)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop", (fields, r.choices[0])
        assert want in ("alpha", "beta", "gamma") or re.fullmatch(r"[0-9]{3}-[a-z]{2}", want)
        streamed = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=20, temperature=0,
                                             stream=True, extra_body=fields)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    r = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=20, temperature=1.0, n=3,
                                  seed=3, extra_body={"guided_choice": ["alpha", "beta", "gamma"]})
    assert all(c.text in ("alpha", "beta", "gamma") for c in r.choices)


TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                           "minimum": 1, "maximum": 3}},
                                                "required": ["city", "days"], "additionalProperties": False,
                                                "x-guidance": {"whitespace_flexible": False}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}}}
# a conversation with an earlier call of get_weather and its result
PARIS_CHAT = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
              {"role": "user", "content": "And tomorrow?"}]


def _paris_chat_answers(client) -> tuple:
    """The chat completion's answers to PARIS_CHAT: get_weather called by name (its tool call), and six
    tokens of text with tool_choice none (its content), which other APIs' answers are held to."""
    kw = dict(model="tiny-mixtral", messages=PARIS_CHAT, tools=[WEATHER, CLOCK], temperature=0)
    named = client.chat.completions.create(max_tokens=80, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}, **kw)
    plain = client.chat.completions.create(max_tokens=6, tool_choice="none", **kw)
    (call,) = named.choices[0].message.tool_calls
    return call, plain.choices[0].message.content


@pytest.fixture(scope="module")
def tool_server(model, tmp_path_factory):
    """The module's model with a chat template that renders tools and earlier calls (Qwen's way, in
    short), served with the hermes tool-call parser."""
    import shutil

    copy = tmp_path_factory.mktemp("tools") / "tiny-mixtral"
    shutil.copytree(model, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    config = json.loads((copy / "config.json").read_text())  # (room for the tools: this tokenizer's tokens are short)
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    s = Server(copy, "--tool-call-parser", "hermes")
    s.model = copy
    yield s
    s.stop()


def _streamed_calls(client, **kw) -> tuple[str, dict[int, dict], str]:
    """A streamed chat answer's (content, tool calls by index with their arguments joined, finish reason)."""
    content, calls, reason = "", {}, None
    for c in client.chat.completions.create(stream=True, **kw):
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or tc.id
            entry["name"] = entry["name"] or (tc.function.name if tc.function else None)
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reason = c.choices[0].finish_reason or reason
    return content, calls, reason


def test_tools_are_rendered_and_called_by_name_required_or_auto(tool_server):
    """The template renders the tools and an earlier call (arguments as an object) as transformers
    does; a named function's arguments, the "required" calls and the hermes blocks an answer writes
    (forced here by a regex: the random model would not write them) come back as tool calls,
    streamed or not."""
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0)
    messages = PARIS_CHAT
    hf_messages = [messages[0], {**messages[1], "content": "", "tool_calls": [{**messages[1]["tool_calls"][0],
                   "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]}, *messages[2:]]
    want = AutoTokenizer.from_pretrained(tool_server.model).apply_chat_template(
        hf_messages, tools=[WEATHER, CLOCK], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    status, body, _ = http("POST", f"{tool_server.url}/tokenize", {"messages": messages, "tools": [WEATHER, CLOCK]})
    assert status == 200 and json.loads(body)["tokens"] == want
    kw = dict(model="tiny-mixtral", messages=messages, tools=[WEATHER, CLOCK], max_tokens=80, temperature=0)

    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    choice = named.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function" and choice.finish_reason == "stop"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 3 and not choice.message.content
    content, calls, reason = _streamed_calls(client, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, **kw)
    assert content == "" and reason == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments and calls[0]["id"]

    required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    call = required.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    content, calls, reason = _streamed_calls(client, tool_choice="required", parallel_tool_calls=False, **kw)
    assert (content, reason) == ("", "tool_calls") and calls[0]["name"] == call.function.name
    assert calls[0]["arguments"] == call.function.arguments

    hermes = 'Let me check\\.\\n<tool_call>\\n\\{"name": "get_time", "arguments": \\{"zone": "UTC"\\}\\}\\n</tool_call>'
    auto = client.chat.completions.create(extra_body={"guided_regex": hermes}, **kw).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in auto.message.tool_calls] == [
        ("get_time", {"zone": "UTC"})]
    content, calls, reason = _streamed_calls(client, extra_body={"guided_regex": hermes}, **kw)
    assert content == "Let me check.\n" and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"zone": "UTC"})]
    plain = client.chat.completions.create(tool_choice="none", **{**kw, "max_tokens": 4}).choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "length"
    # what cannot be had is a 400 naming the field
    chat = f"{tool_server.url}/v1/chat/completions"
    for body, param in [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
                         "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": {"function": {"name": ["get_weather"]}}}, "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": {"function": {"name": {"a": 1}}}}, "tool_choice"),
                        ({"guided_grammar": 'start: "a" <|nosuch|>'}, "guided_grammar")]:
        status, raw, _ = http("POST", chat, {"messages": messages[:1], **body})
        assert status == 400 and json.loads(raw)["error"]["param"] == param, (body, raw)


MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def mistral_server(model, tmp_path_factory):
    """The module's model with a special [TOOL_CALLS] token (in place of <|im_start|>, id 2) and a
    Mistral-style template, served with the mistral tool-call parser."""
    import shutil

    copy = tmp_path_factory.mktemp("mistral") / "tiny-mixtral"
    shutil.copytree(model, copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (copy / name).write_text((copy / name).read_text().replace("<|im_start|>", "[TOOL_CALLS]"))
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": MISTRAL_TEMPLATE}))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    s = Server(copy, "--tool-call-parser", "mistral")
    yield s
    s.stop()


def test_mistral_calls_are_read_after_their_special_token(mistral_server):
    """The mistral parser finds its calls after [TOOL_CALLS], a special token (forced here by a grammar
    that names it by id: the random model would not write it), which the answer's text keeps for it;
    the calls' ids are nine letters and digits, as Mistral's templates take them back."""
    client = openai.OpenAI(base_url=f"{mistral_server.url}/v1", api_key="unused", max_retries=0)
    kw = dict(model="tiny-mixtral", messages=[{"role": "user", "content": "What time is it?"}], tools=[WEATHER, CLOCK],
              max_tokens=60, temperature=0, extra_body={"guided_grammar": (
                  'start: "Sure." <[2]> " [{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"CET\\"}}]"')})
    answer = client.chat.completions.create(**kw).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls] == [
        ("get_time", {"zone": "CET"})]
    assert len(answer.message.tool_calls[0].id) == 9 and answer.message.tool_calls[0].id.isalnum()
    content, calls, reason = _streamed_calls(client, **kw)
    assert (content, reason) == ("Sure.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"zone": "CET"})]
    # without a call, the answer is its text
    plain = client.chat.completions.create(**{**kw, "extra_body": {"guided_regex": "It is noon\\."}}).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == ("It is noon.", None, "stop")


THINKING_TEMPLATE = (
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% elif open_thought is defined and open_thought or reasoning_effort is defined or "
    "enable_thinking is defined and enable_thinking %}<think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(model, tmp_path_factory):
    """The module's model with special <think> and </think> tokens (in place of <|im_start|> and
    <|im_end|>, ids 2 and 3; EOS <|endoftext|> alone), a template that may open the thought (as Qwen3's
    thinking models' do) or close it at once (enable_thinking false), served with the qwen3 parser."""
    import shutil

    copy = tmp_path_factory.mktemp("thinking") / "tiny-mixtral"
    shutil.copytree(model, copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        text = (copy / name).read_text().replace("<|im_start|>", "<think>").replace("<|im_end|>", "</think>")
        (copy / name).write_text(text)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [0]}))
    s = Server(copy, "--reasoning-parser", "qwen3")
    s.model = copy
    yield s
    s.stop()


def _streamed_thought(client, **kw) -> tuple[str | None, str | None, str]:
    """A streamed chat answer's (reasoning, content, finish reason), None where nothing came."""
    thought, content, reason, named = "", "", None, set()
    for c in client.chat.completions.create(stream=True, **kw):
        delta = c.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")  # (vLLM's name and DeepSeek's)
        thought += extra.get("reasoning") or ""
        content += delta.content or ""
        reason = c.choices[0].finish_reason or reason
    return thought or None, content or None, reason


def test_a_thinking_models_thought_comes_apart_from_its_answer(thinking_server):
    """The answer's thought is `reasoning` (and `reasoning_content`), the rest its content, streamed
    or not, as gateway/reasoning.py splits the in-process engine's text of the same prompt. A prompt
    whose template opens the thought starts the answer inside it; a constraint applies after the
    thought (here made short by a logit_bias on </think>), which is free."""
    from gateway.reasoning import ReasoningMode, split
    from moemesh.structured import after_thought, grammar_of
    from moemesh.tokenizer import TextTokenizer

    model = thinking_server.model
    tok = TextTokenizer(model)
    client = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Is Paris in France?"}]
    kw = dict(model="tiny-mixtral", messages=messages, max_tokens=12, temperature=0)

    def prompt(**template) -> list[int]:
        status, body, _ = http("POST", f"{thinking_server.url}/tokenize", {"messages": messages,
                                                                          "chat_template_kwargs": template})
        assert status == 200
        return json.loads(body)["tokens"]

    for template, opened in [({"open_thought": True}, True), ({}, False), ({"enable_thinking": False}, False)]:
        ids = prompt(**template)
        assert (ids[-1] == 2) == opened  # (<think>, a special token, ends the prompt that opens the thought)
        tokens = engine_greedy(model, ids, 12)
        text = tok.decode(tokens, skip_special_tokens=False)
        want = split(ReasoningMode.of("qwen3", opened), text)
        assert 2 not in tokens and 3 not in tokens  # (the model writes no tag: the split is all or nothing)
        assert want == ((text.lstrip("\n"), None) if opened else (None, text))
        answer = client.chat.completions.create(extra_body={"chat_template_kwargs": template, "ignore_eos": True},
                                                **kw).choices[0]
        extra = answer.message.model_extra
        assert (extra["reasoning"], answer.message.content) == want and extra["reasoning_content"] == want[0]
        assert _streamed_thought(client, extra_body={"chat_template_kwargs": template, "ignore_eos": True},
                                 **kw) == (*want, "length")
        if want[0] is not None:  # include_reasoning false: the thought is left out, the content stays
            hidden = client.chat.completions.create(extra_body={"chat_template_kwargs": template, "ignore_eos": True,
                                                                "include_reasoning": False}, **kw).choices[0]
            assert (hidden.message.model_extra["reasoning"], hidden.message.content) == (None, want[1])
            assert _streamed_thought(client, extra_body={"chat_template_kwargs": template, "ignore_eos": True,
                                                         "include_reasoning": False}, **kw)[:2] == (None, want[1])

    # a choice after the thought: the prompt opens it, and the answer thinks, closes it, and answers
    ids = prompt(open_thought=True)
    choice = {"guided_choice": ["yes", "no"]}
    import llguidance

    grammar = after_thought(grammar_of(choice), True, (2, 3), (0,))
    eos = [0]
    assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar, llguidance.LLTokenizer(
        (model / "tokenizer.json").read_text(), n_vocab=SPEC.vocab_size, eos_token=eos))[0] is False
    bias = {"3": 3}  # (five tokens of thought, then </think>)
    tokens = engine_greedy(model, ids, 12, grammar=grammar, logit_bias=((3, 3.0),))
    assert tokens[-1] == 0  # (the answer ends the sequence: EOS, which is no text)
    text = tok.decode(tokens[:-1], skip_special_tokens=False)
    want = split(ReasoningMode.of("qwen3", True), text)
    assert want[0] and want[1] in ("yes", "no") and 3 in tokens
    answer = client.chat.completions.create(extra_body={"chat_template_kwargs": {"open_thought": True},
                                                        "logit_bias": bias, "ignore_eos": True, **choice}, **kw)
    assert (answer.choices[0].message.model_extra["reasoning"], answer.choices[0].message.content) == want
    assert answer.choices[0].finish_reason == "stop"
    assert _streamed_thought(client, extra_body={"chat_template_kwargs": {"open_thought": True}, "logit_bias": bias,
                                                 "ignore_eos": True, **choice}, **kw) == (*want, "stop")

    # a function called by name, after the thought: its arguments are the answer after it
    from gateway.tools import functions, tool_mode

    _, fields = tool_mode(functions([CLOCK]), {"type": "function", "function": {"name": "get_time"}}, None, None)
    tokens = engine_greedy(model, ids, 40, grammar=after_thought(grammar_of(fields), True, (2, 3), (0,)),
                           logit_bias=((3, 3.0),))
    thought, arguments = split(ReasoningMode.of("qwen3", True), tok.decode(tokens[:-1], skip_special_tokens=False))
    assert thought and json.loads(arguments)["zone"] in ("UTC", "CET")
    named = dict(tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 extra_body={"chat_template_kwargs": {"open_thought": True}, "logit_bias": bias, "ignore_eos": True},
                 **{**kw, "max_tokens": 40})
    message = client.chat.completions.create(**named).choices[0].message
    (call,) = message.tool_calls
    assert (message.model_extra["reasoning"], message.content, call.function.arguments) == (thought, None, arguments)
    assert _streamed_thought(client, **named)[:2] == (thought, None)
    assert _streamed_calls(client, **named)[1][0]["arguments"] == arguments


def _response_events(client, **kw) -> tuple[list, object]:
    """A streamed response's events (numbered in order, opened and closed as OpenAI's) and its last."""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == sorted(added) == [e.output_index for e in events if e.type == "response.output_item.done"]
    return events, events[-1].response


def test_responses_answer_as_chat_completions_do(client):
    """/v1/responses (OpenAI's Responses API, through the openai client) answers with the tokens the chat
    completion of the same conversation gives: instructions as the system message, input as a string or
    items with text parts, streamed or not; what it cannot serve is a 400 naming the field."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_completion_tokens=10,
                                          temperature=0)
    want, reason = chat.choices[0].message.content, chat.choices[0].finish_reason
    kw = dict(model="tiny-mixtral", instructions="Be brief.", max_output_tokens=10, temperature=0)
    for given in ["Name a colour.", [{"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}],
                  [{"type": "message", "role": "user", "content": "Name a colour."}]]:
        r = client.responses.create(input=given, **kw)
        assert r.output_text == want and r.status == ("incomplete" if reason == "length" else "completed")
        assert [item.type for item in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
        assert r.usage.output_tokens_details.reasoning_tokens == 0 and r.store is True
    developer = client.responses.create(input=[{"role": "developer", "content": "Be brief."},
                                               {"role": "user", "content": "Name a colour."}],
                                        **{**kw, "instructions": None})
    assert developer.output_text == want  # (a developer message is the system's)
    events, last = _response_events(client, input="Name a colour.", **kw)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert last.output[0].content[0].text == want and last.usage.output_tokens == chat.usage.completion_tokens
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == want
    url = client.base_url.__str__().replace("/v1/", "/v1/responses")
    for body, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input"),
                        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
                        ({"text": {"format": {"type": "yaml"}}}, "text"),
                        ({"truncation": "auto"}, "truncation"),
                        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
                        ({"input": 5}, "input"),
                        ({"max_output_tokens": 0}, "max_output_tokens"),
                        ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
                         "text")]:
        status, raw, _ = http("POST", url, {"model": "tiny-mixtral", "input": "hi", **body})
        assert status == 400 and json.loads(raw)["error"]["param"] == param, (body, raw)


def test_responses_are_kept_continued_listed_and_deleted(client):
    """A response is kept (store, OpenAI's default): retrieved as it was answered, continued by a later
    request's previous_response_id as the whole conversation sent as input is answered, its input items
    listed; one with store false is not kept, and a deleted one is gone."""
    kw = dict(model="tiny-mixtral", max_output_tokens=6, temperature=0)
    first = client.responses.create(input="Name a colour.", instructions="Be brief.", **kw)
    assert first.store is True and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(input="And another?", previous_response_id=first.id, instructions="Be terse.",
                                     **kw)
    whole = client.responses.create(input=[
        {"role": "user", "content": "Name a colour."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And another?"}], instructions="Be terse.", store=False, **kw)
    assert (second.output_text, second.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    assert second.previous_response_id == first.id and whole.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    (item,) = client.responses.input_items.list(second.id).data
    assert (item.type, item.role, item.content[0].text) == ("message", "user", "And another?")
    events, last = _response_events(client, input="Name a colour.", instructions="Be brief.", **kw)  # (kept too)
    assert client.responses.retrieve(last.id).output_text == last.output_text == first.output_text
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="More?", previous_response_id=first.id, **kw)
    assert e.value.body["param"] == "previous_response_id" and "not found" in e.value.body["message"]
    url = client.base_url.__str__().replace("/v1/", f"/v1/responses/{second.id}")
    for query, param in [("/input_items?limit=0", "limit"), ("/input_items?order=up", "order"),
                         ("/input_items?after=msg_x", "after"), ("?stream=true", "stream")]:
        status, raw, _ = http("GET", url + query)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, (query, raw)


def test_responses_call_tools_and_take_their_outputs_back(tool_server):
    """A function tool (Responses' flat shape) called by name comes back as a function_call item with the
    chat completion's arguments, streamed or not; an earlier call and its output, sent back as input
    items, render as the chat's assistant tool call and tool message do (the same answer)."""
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0)
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "user", "content": "And tomorrow?"}]
    want, want_text = _paris_chat_answers(client)
    kw = dict(model="tiny-mixtral", input=items, tools=flat, max_output_tokens=80, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**kw)
    (call,) = r.output
    assert (call.type, call.name, call.arguments, r.status) == ("function_call", "get_weather",
                                                                want.function.arguments, "completed")
    assert call.call_id and call.id.startswith("fc_")
    events, last = _response_events(client, **kw)
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [(o.type, o.name, o.arguments) for o in last.output] == [("function_call", "get_weather", call.arguments)]
    with client.responses.stream(**kw) as stream:  # (the SDK's own stream reader takes the events whole)
        final = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", call.arguments)]
    plain = client.responses.create(**{**kw, "tool_choice": "none", "max_output_tokens": 6})
    assert plain.output_text == want_text  # (the items render as the chat's messages)


def test_responses_give_the_thought_as_a_reasoning_item(thinking_server):
    """With a --reasoning-parser the thought is a reasoning item before the answer's (here the template
    opens the thought for reasoning.effort, as the chat's chat_template_kwargs would), its tokens counted
    as reasoning tokens."""
    client = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny-mixtral", messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=12,
        temperature=0, extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
    thought, content = chat.choices[0].message.model_extra["reasoning"], chat.choices[0].message.content
    assert thought and content is None  # (the random model does not close it)
    # OpenAI's top-level reasoning_effort reaches the template as well (it had been dropped unread)
    effort = client.chat.completions.create(
        model="tiny-mixtral", messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=12,
        temperature=0, reasoning_effort="low")
    assert effort.choices[0].message.model_extra["reasoning"] == thought
    for legacy in ({"functions": [{"name": "f", "parameters": {}}]}, {"function_call": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:  # (the legacy forms of tools: refused, not ignored)
            client.chat.completions.create(model="tiny-mixtral", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, extra_body=legacy)
        assert e.value.body["param"] == next(iter(legacy))
    kw = dict(model="tiny-mixtral", input="Is Paris in France?", max_output_tokens=12, temperature=0,
              reasoning={"effort": "low"})
    r = client.responses.create(**kw)
    (item,) = r.output
    assert item.type == "reasoning" and item.content[0].text == thought and r.status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
    events, last = _response_events(client, **kw)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert last.output[0].content[0].text == thought and last.usage.output_tokens_details.reasoning_tokens == 12


def test_anthropic_messages_answer_as_chat_completions_do(server, client):
    """/v1/messages (Anthropic's Messages API, through the anthropic client) answers with the tokens the chat
    completion of the same conversation gives, streamed or not; a stop sequence is named; errors are
    Anthropic's shape."""
    anthropic = pytest.importorskip("anthropic")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_completion_tokens=10,
                                          temperature=0)
    want, reason = chat.choices[0].message.content, chat.choices[0].finish_reason
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = dict(model="tiny-mixtral", system="Be brief.", max_tokens=10, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}])
    m = claude.messages.create(**kw)
    assert [(b.type, b.text) for b in m.content] == [("text", want)]
    assert m.stop_reason == ("max_tokens" if reason == "length" else "end_turn") and m.role == "assistant"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    counted = claude.messages.count_tokens(model="tiny-mixtral", system="Be brief.", messages=kw["messages"])
    assert counted.input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == want
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", want)] and final.stop_reason == m.stop_reason
    # an assistant's text last is a prefill the answer continues, as the chat's continue_final_message
    prefilled = client.chat.completions.create(
        model="tiny-mixtral", messages=[*messages, {"role": "assistant", "content": "The"}], max_completion_tokens=10,
        temperature=0, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    m = claude.messages.create(**{**kw, "messages": [*kw["messages"], {"role": "assistant", "content": "The"}]})
    assert m.content[0].text == prefilled.choices[0].message.content
    # a max_tokens past the context (as Anthropic's clients send) is lowered to what it leaves, not refused
    with claude.messages.stream(**{**kw, "max_tokens": 100_000}) as stream:  # (the SDK streams one that large)
        long = stream.get_final_message()
    assert long.stop_reason in ("end_turn", "model_context_window_exceeded") and long.content[0].text.startswith(want)
    stop = want.strip()[2:5]  # (a stop sequence inside the answer: it ends there, and is named)
    cut = claude.messages.create(stop_sequences=[stop], **kw)
    assert (cut.content[0].text, cut.stop_reason, cut.stop_sequence) == (want[:want.find(stop)], "stop_sequence", stop)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**{**kw, "messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "text only" in e.value.body["error"]["message"]
    status, body, _ = http("POST", f"{server.url}/v1/messages", {"messages": kw["messages"]})  # (no max_tokens)
    assert status == 400 and json.loads(body)["type"] == "error" and "max_tokens" in json.loads(body)["error"]["message"]


def test_anthropic_tool_use_and_results_go_round_as_chat_tool_calls_do(tool_server):
    """A tool chosen by name comes back as a tool_use block whose input is the chat completion's
    arguments, streamed or not; earlier tool_use and tool_result blocks render as the chat's tool calls
    and tool messages do (the same answer)."""
    anthropic = pytest.importorskip("anthropic")
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0)
    claude = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, CLOCK)]
    blocks = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                 "input": {"city": "Paris", "days": 1}}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                                           {"type": "text", "text": "And tomorrow?"}]}]
    want, want_text = _paris_chat_answers(client)
    kw = dict(model="tiny-mixtral", messages=blocks, tools=tools, max_tokens=80, extra_body={"temperature": 0},
              tool_choice={"type": "tool", "name": "get_weather"})
    m = claude.messages.create(**kw)
    (use,) = m.content
    assert (use.type, use.name, use.input, m.stop_reason) == ("tool_use", "get_weather",
                                                              json.loads(want.function.arguments), "tool_use")
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", use.input)]
    plain = claude.messages.create(**{**kw, "tool_choice": {"type": "none"}, "max_tokens": 6})
    assert plain.content[0].text == want_text  # (the blocks render as the chat's messages)


def test_anthropic_thinking_comes_back_as_a_thinking_block(thinking_server):
    anthropic = pytest.importorskip("anthropic")
    client = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny-mixtral", messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=12,
        temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    thought = chat.choices[0].message.model_extra["reasoning"]
    assert thought and chat.choices[0].message.content is None
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="unused", max_retries=0)
    kw = dict(model="tiny-mixtral", messages=[{"role": "user", "content": "Is Paris in France?"}], max_tokens=12,
              extra_body={"temperature": 0}, thinking={"type": "enabled", "budget_tokens": 1024})
    m = claude.messages.create(**kw)
    assert [(b.type, b.thinking) for b in m.content] == [("thinking", thought)] and m.stop_reason == "max_tokens"
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", thought)]


def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_last_stage(server, model):
    """OpenAI's logit_bias and vLLM's allowed_token_ids and bad_words give the in-process engine's tokens
    under the same edit (tests/test_logit_bias.py holds those to transformers), in completions and chat."""
    from moemesh.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    prompt = tok.encode("Once upon a time")
    plain = engine_greedy(model, prompt, 6)
    bias = {str(plain[0]): -100, str(plain[1]): 5.5, "300": 3}
    allowed = [t for t in range(4, 400, 3) if t not in plain]
    for fields, params in (({"logit_bias": bias}, {"logit_bias": tuple((int(k), float(v)) for k, v in bias.items())}),
                           ({"allowed_token_ids": allowed}, {"allowed_token_ids": tuple(allowed)})):
        want = engine_greedy(model, prompt, 6, **params)
        assert want != plain
        r = json.loads(http("POST", f"{server.url}/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                                     "temperature": 0, "ignore_eos": True,
                                                                     **fields})[1])
        assert r["choices"][0]["text"] == tok.decode(want), fields
    # bad_words: each word as written at the start and after a space (the engine given those sequences)
    words = [w for w in (tok.decode([t]).strip() for t in plain) if w.isalpha()][:2]  # (its whole-word tokens)
    assert words
    sequences = tuple(dict.fromkeys(tuple(tok.encode(t, add_special_tokens=False)) for w in words
                                    for t in (w, " " + w)))
    want = engine_greedy(model, prompt, 6, bad_words=sequences)
    r = json.loads(http("POST", f"{server.url}/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                                 "ignore_eos": True, "bad_words": words})[1])
    assert r["choices"][0]["text"] == tok.decode(want) != tok.decode(plain)
    forced = json.loads(http("POST", f"{server.url}/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0.7, "seed": 5,
        "logit_bias": {str(plain[2]): 100}, "min_tokens": 4})[1])
    assert forced["choices"][0]["message"]["content"] == tok.decode([plain[2]] * 4)


def test_vllm_extras_stop_string_kept_truncated_prompt_and_the_sampled_token_among_the_top(server, model):
    """include_stop_str_in_output keeps the stop string, truncate_prompt_tokens keeps the prompt's last
    tokens, and each position's top_logprobs holds the sampled token (OpenAI: up to logprobs + 1)."""
    from moemesh.tokenizer import TextTokenizer

    url = f"{server.url}/v1/completions"
    base = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = json.loads(http("POST", url, base)[1])["choices"][0]["text"]
    stop = full.strip()[2:5]
    assert stop and stop in full
    for stream in (False, True):
        status, body, _ = http("POST", url, {**base, "stop": [stop], "include_stop_str_in_output": True,
                                             "stream": stream})
        assert status == 200
        if stream:
            events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith(b"data: {")]
            text = "".join(c["text"] for e in events for c in e["choices"])
        else:
            text = json.loads(body)["choices"][0]["text"]
        assert text == full[:full.index(stop) + len(stop)], stream
    cut = json.loads(http("POST", url, {**base, "stop": [stop]})[1])["choices"][0]["text"]
    assert cut == full[:full.index(stop)]
    # max_tokens left out: 16 (OpenAI); null: the rest of the context (vLLM)
    unset = json.loads(http("POST", url, {k: v for k, v in base.items() if k != "max_tokens"})[1])["usage"]
    null = json.loads(http("POST", url, {**base, "max_tokens": None})[1])["usage"]
    assert unset["completion_tokens"] == 16 and null["prompt_tokens"] + null["completion_tokens"] == 256
    # a stop token's text is no part of the answer unless include_stop_str_in_output (as vLLM)
    tok = TextTokenizer(model)
    prompt = tok.encode("The quick brown fox")
    out = engine_greedy(model, prompt, 12)
    k = next(i for i in range(2, 12) if out[i] not in out[:i])
    after = lambda n: tok.decode(prompt + out[:n])[len(tok.decode(prompt)):]  # noqa: E731
    for include, want in ((False, after(k)), (True, after(k + 1))):
        r = json.loads(http("POST", url, {**base, "prompt": prompt, "stop_token_ids": [out[k]],
                                          "include_stop_str_in_output": include})[1])
        assert r["choices"][0]["text"] == want and r["usage"]["completion_tokens"] == k + 1, include
    ids = TextTokenizer(model).encode("The quick brown fox")
    status, body, _ = http("POST", url, {**base, "prompt": ids, "truncate_prompt_tokens": 2, "echo": True,
                                         "max_tokens": 1})
    r = json.loads(body)
    assert status == 200 and r["usage"]["prompt_tokens"] == 2
    assert r["choices"][0]["text"].startswith(TextTokenizer(model).decode(ids[-2:], skip_special_tokens=False))
    status, body, _ = http("POST", url, {**base, "temperature": 1.0, "seed": 3, "logprobs": 0, "max_tokens": 6})
    lp = json.loads(body)["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    assert [top[t] for top, t in zip(lp["top_logprobs"], lp["tokens"])] == lp["token_logprobs"]


def test_usage_counts_each_prompt_once_and_tiny_temperatures_are_greedy(client):
    from moemesh.tokenizer import TextTokenizer

    r = client.completions.create(model="tiny-mixtral", prompt=["Once upon", "The quick brown fox"], n=2,
                                  max_tokens=3, temperature=1.0, seed=1)
    assert r.usage.prompt_tokens == sum(len(TextTokenizer(client.model_dir).encode(p))
                                        for p in ["Once upon", "The quick brown fox"])
    assert r.usage.completion_tokens == 12
    greedy = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    for kw in [dict(temperature=1e-300), dict(temperature=1.0, top_p=1e-300)]:  # (float32 overflows, underflows)
        got = client.completions.create(model="tiny-mixtral", prompt="Once upon", max_tokens=6, seed=3,
                                        extra_body={"ignore_eos": True}, **kw).choices[0].text
        assert got == greedy, kw


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(server):
    """OpenAI's legacy scoring (and vLLM's): echo with max_tokens 0 answers the prompt and its logprobs,
    streamed or not, with no completion tokens; the logprobs are those a longer request echoes."""
    url = f"{server.url}/v1/completions"
    body = {"prompt": ["Once upon a time", "The quick brown fox"], "max_tokens": 0, "echo": True, "logprobs": 1}
    status, raw, _ = http("POST", url, body)
    assert status == 200, raw
    r = json.loads(raw)
    longer = json.loads(http("POST", url, {**body, "max_tokens": 3, "temperature": 0})[1])
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == longer["usage"]["prompt_tokens"]
    for c, whole in zip(r["choices"], longer["choices"]):
        assert c["text"] == body["prompt"][c["index"]] and c["finish_reason"] == "length"
        k = len(c["logprobs"]["tokens"])
        assert c["logprobs"]["token_logprobs"][0] is None and k == len(whole["logprobs"]["tokens"]) - 3
        assert {key: v[:k] for key, v in whole["logprobs"].items()} == c["logprobs"]
    events = _sse(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["completion_tokens"] == 0
    assert "usage" not in _sse(url, {**body, "stream": True, "stream_options": {"include_usage": None}})[-1]
    for c in r["choices"]:
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == c["index"]]
        assert "".join(x["text"] for x in chunks) == c["text"] and chunks[-1]["finish_reason"] == "length"
        assert sum((x["logprobs"]["tokens"] for x in chunks), []) == c["logprobs"]["tokens"]
    # without echo, max_tokens 0 asks for nothing: refused
    assert http("POST", url, {"prompt": "x", "max_tokens": 0})[0] == 400


def test_beam_search_finds_the_beams_transformers_finds(model, server):
    """use_beam_search: the n best of best_of beams are transformers' generate(num_beams=best_of,
    num_return_sequences=n), token for token and score for score, with its length_penalty and
    early_stopping, stop tokens and min_tokens (min_new_tokens); streamed, the same choices."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = list(hf.generation_config.eos_token_id)
    url = f"{server.url}/v1/completions"
    cases = [([5, 17, 42, 99], 4, 4, 10, 1.0, False, 0), ([3, 1, 4, 1, 5, 9, 2, 6], 3, 2, 12, 0.5, "never", 0),
             ([7, 7, 7], 3, 2, 10, 1.0, True, 0), ([11, 12], 5, 3, 8, 2.0, False, 0),
             ([11, 12], 4, 3, 8, -1.0, "never", 0), ([5, 17, 42, 99], 3, 3, 10, 1.0, False, 4)]
    stopped = 0
    for prompt, width, n, new, penalty, early, min_tokens in cases:
        plain = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, max_new_tokens=new,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
        stop = int(plain[1, len(prompt) + 2])  # (a token some beam makes early: beams end on it)
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=n, max_new_tokens=new,
                          do_sample=False, length_penalty=penalty, early_stopping=early, eos_token_id=[*eos, stop],
                          min_new_tokens=min_tokens, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        want = []
        for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
            ends = [k for k, t in enumerate(row) if t in (*eos, stop)]
            row = row[:ends[0] + 1] if ends else row
            want.append((row, "stop" if ends else "length", score))
        body = {"prompt": prompt, "max_tokens": new, "use_beam_search": True, "n": n, "best_of": width,
                "length_penalty": penalty, "early_stopping": early, "stop_token_ids": [stop], "min_tokens": min_tokens,
                "logprobs": 1, "include_stop_str_in_output": True, "skip_special_tokens": False}
        status, raw, _ = http("POST", url, body)
        assert status == 200, raw
        choices = json.loads(raw)["choices"]
        assert [c["index"] for c in choices] == list(range(n))
        for c, (row, reason, score) in zip(choices, want):
            lps = c["logprobs"]
            assert c["text"] == tokenizer.decode(row) and len(lps["tokens"]) == len(row), (c, row)
            assert c["finish_reason"] == reason, (c, row, body)
            assert len(row) >= min_tokens
            assert sum(lps["token_logprobs"]) / len(row) ** penalty == pytest.approx(score, abs=1e-4)
            for top, logprob in zip(lps["top_logprobs"], lps["token_logprobs"]):  # (the likeliest, and the token)
                assert 1 <= len(top) <= 2 and max(top.values()) >= logprob
            stopped += reason == "stop"
        events = _sse(url, {**body, "stream": True})
        for c in choices:
            assert "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == c["index"]) \
                == c["text"]
    assert stopped >= 3  # (the stop tokens ended beams: that path was taken)


def test_beam_search_through_chat_and_what_it_refuses(model, server):
    chat = f"{server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = json.loads(http("POST", f"{server.url}/tokenize", {"messages": messages})[1])["tokens"]
    status, raw, _ = http("POST", chat, {"messages": messages, "use_beam_search": True, "n": 2, "max_tokens": 6,
                                         "ignore_eos": True})
    assert status == 200, raw
    got = [c["message"]["content"] for c in json.loads(raw)["choices"]]
    status, raw, _ = http("POST", f"{server.url}/v1/completions", {
        "prompt": ids, "use_beam_search": True, "n": 2, "max_tokens": 6, "ignore_eos": True})
    assert got == [c["text"] for c in json.loads(raw)["choices"]] and len(set(got)) == 2
    url, beam = f"{server.url}/v1/completions", {"prompt": "x", "use_beam_search": True, "max_tokens": 4}
    for extra, param in [({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 17}, "best_of"), ({"n": 11}, "n"),
                         ({"stop": "."}, "stop"), ({"top_p": 0.5}, "top_p"), ({"repetition_penalty": 1.2},
                                                                             "repetition_penalty"),
                         ({"guided_regex": "a+"}, "guided_regex"), ({"early_stopping": "soon"}, "early_stopping"),
                         ({"length_penalty": 2000}, "length_penalty"), ({"length_penalty": -11}, "length_penalty"),
                         ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"echo": True, "logprobs": 1}, "echo"),
                         ({"logit_bias": {"5": 1}}, "logit_bias")]:
        status, raw, _ = http("POST", url, {**beam, **extra})
        assert status == 400 and json.loads(raw)["error"]["param"] == param, (extra, raw)
    # a client that leaves mid-search: every beam's step is aborted, and their blocks come back
    aborted = metric(server, "vllm:request_success_total", finished_reason="abort")
    conn = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "a long one", "max_tokens": 200, "use_beam_search": True, "n": 4,
                       "ignore_eos": True}).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    # (each wait its own deadline: /metrics shows the status as last polled, and a loaded CI machine once
    # spent a shared 10 s before the search was seen running)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not metric(server, "vllm:num_requests_running"):
        time.sleep(0.02)
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (metric(server, "vllm:num_requests_running") or
                                           metric(server, "vllm:kv_cache_usage_perc")):
        time.sleep(0.2)
    assert metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:kv_cache_usage_perc") == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(server, "vllm:request_success_total", finished_reason="abort") \
            < aborted + 4:
        time.sleep(0.1)
    assert metric(server, "vllm:request_success_total", finished_reason="abort") == aborted + 4  # (its 4 choices)
    # temperature and seed only shape a draw, which a search makes none of
    assert json.loads(http("POST", url, {**beam, "temperature": 0.8, "seed": 3})[1])["choices"] == \
        json.loads(http("POST", url, beam)[1])["choices"]


def _sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_streamed_chunks_carry_their_own_logprobs_and_finish_reason_under_load(server):
    """32 streams, 12 at a time, two choices each, with logprobs: each chunk's logprobs are its own
    tokens', in order (together, with their text_offsets, the non-streamed answer's), and each
    choice has one finish_reason, on its last chunk."""
    from concurrent.futures import ThreadPoolExecutor

    url = f"{server.url}/v1/completions"
    bodies = [{"prompt": f"Story {i}:", "max_tokens": 10, "temperature": 0, "logprobs": 1, "n": 2, "seed": i,
               "ignore_eos": True, "echo": i % 4 == 0} for i in range(32)]
    with ThreadPoolExecutor(12) as pool:
        streamed = list(pool.map(lambda b: _sse(url, {**b, "stream": True}), bodies))
    for body, events in zip(bodies, streamed):
        whole = json.loads(http("POST", url, body)[1])["choices"]
        for index in (0, 1):
            chunks = [c for e in events for c in e["choices"] if c["index"] == index]
            reasons = [c["finish_reason"] for c in chunks]
            assert reasons[-1] == "length" and not any(reasons[:-1]), reasons
            text, tokens, values, offsets = "", [], [], []
            for c in chunks:
                lp = c["logprobs"]
                text += c["text"]
                tokens += lp["tokens"]
                values += lp["token_logprobs"]
                offsets += lp["text_offset"]
            assert text == whole[index]["text"] and tokens == whole[index]["logprobs"]["tokens"]
            assert offsets == whole[index]["logprobs"]["text_offset"]
            want = whole[index]["logprobs"]["token_logprobs"]  # (other batches: float rounding apart)
            assert [v is None for v in values] == [w is None for w in want]
            assert all(abs(v - w) < 1e-4 for v, w in zip(values, want) if v is not None)


def test_chat_options_render_as_transformers_renders_them(model, server, client):
    """add_generation_prompt, continue_final_message (the answer continues the last message), text
    parts (joined by newlines, as vLLM joins them) and add_special_tokens give the token ids
    transformers' apply_chat_template gives, on /tokenize and on the chat endpoint (its prompt
    tokens); options this server does not take are a 400, never ignored."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(model)
    user = {"role": "user", "content": "Name a colour."}
    partial = {"role": "assistant", "content": "The colour is "}
    cases = [  # (body fields, messages, apply_chat_template's arguments)
        ({"add_generation_prompt": False}, [user], dict(add_generation_prompt=False)),
        ({"add_generation_prompt": False, "continue_final_message": True}, [user, partial],
         dict(add_generation_prompt=False, continue_final_message=True)),
        ({"chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True}}, [user, partial],
         dict(add_generation_prompt=False, continue_final_message=True)),
    ]
    for fields, messages, theirs in cases:
        want = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True, **theirs)["input_ids"]
        status, body, _ = http("POST", f"{server.url}/tokenize", {"messages": messages, **fields})
        assert status == 200 and json.loads(body)["tokens"] == want, fields
        r = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"ignore_eos": True, **fields})
        assert r.usage.prompt_tokens == len(want), fields
    # a last message that also ends the template's end-of-turn token ("d" of <|im_end|>): cut after the
    # message, never inside the token (where transformers' search from the end would cut)
    short = [user, {"role": "assistant", "content": "d"}]
    text = hf_tok.apply_chat_template(short, add_generation_prompt=False, tokenize=False)
    want = hf_tok(text[:text.rindex("d<|im_end|>") + 1], add_special_tokens=False)["input_ids"]
    status, body, _ = http("POST", f"{server.url}/tokenize", {"messages": short, "add_generation_prompt": False,
                                                              "continue_final_message": True})
    assert status == 200 and json.loads(body)["tokens"] == want
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    want = hf_tok.apply_chat_template([{"role": "user", "content": "Name\na colour."}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    assert json.loads(http("POST", f"{server.url}/tokenize", {"messages": parts})[1])["tokens"] == want
    with_bos = json.loads(http("POST", f"{server.url}/tokenize", {"messages": [user], "add_special_tokens": True})[1])
    plain = json.loads(http("POST", f"{server.url}/tokenize", {"messages": [user]})[1])
    assert with_bos["tokens"] == hf_tok(hf_tok.apply_chat_template([user], add_generation_prompt=True,
                                                                    tokenize=False))["input_ids"]
    assert plain["tokens"] == hf_tok.apply_chat_template([user], add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]
    url = client.base_url.__str__() + "chat/completions"
    for fields, param in [({"continue_final_message": True}, "continue_final_message"),
                          ({"echo": True}, "echo"), ({"chat_template": "{{ messages }}"}, "chat_template"),
                          ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                              "url": "http://x/y.png"}}]}]}, "messages"),
                          ({"messages": [user, {"role": "assistant", "content": " "}], "continue_final_message": True,
                            "add_generation_prompt": False}, "continue_final_message")]:
        status, body, _ = http("POST", url, {"messages": [user, partial], "max_tokens": 2, **fields})
        assert status == 400 and json.loads(body)["error"]["param"] == param, (fields, body)

def test_a_mesh_its_launcher_gave_up_on_is_a_503_at_once(model):
    """`serve` tells its gateway when the launcher gives up on the mesh (a child past its restart
    budget): /health, /ready and new requests are a 503 with the reason from then on, though the
    coordinator may still answer (it would wait --recovery-timeout for a replacement that never comes)."""
    import asyncio

    import aiohttp

    from gateway.server import run_gateway
    from moemesh.entrypoints.launcher import LocalMesh
    from moemesh.settings import EngineSettings, GatewaySettings

    async def scenario():
        with LocalMesh.of(EngineSettings(model=str(model), kv_memory=4 << 20)) as mesh:
            ready, urls = asyncio.Event(), []
            down = asyncio.get_running_loop().create_future()
            server = asyncio.ensure_future(run_gateway(GatewaySettings(coordinator=mesh.client_address, port=0),
                                                       ready, urls, down))
            try:
                await asyncio.wait_for(ready.wait(), 120)
                async with aiohttp.ClientSession() as http_session:
                    async def get(path, body=None):
                        call = http_session.post if body else http_session.get
                        async with call(urls[0] + path, json=body) as r:
                            return r.status, await r.json()

                    assert (await get("/health"))[0] == 200
                    down.set_result("the mesh is down: stage worker pp=0 tp=0 past its restart budget")
                    await asyncio.sleep(0.7)  # (and a status poll that still hears the coordinator)
                    results = [await get("/health"), await get("/ready"),
                               await get("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})]
            finally:
                server.cancel()
                await asyncio.gather(server, return_exceptions=True)
        return results

    (health, h), (ready, r), (gen, g) = asyncio.run(scenario())
    assert (health, ready, gen) == (503, 503, 503)
    assert "past its restart budget" in h["error"]["message"] and "past its restart budget" in r["reason"]
    assert "past its restart budget" in g["error"]["message"]

def test_a_bug_mid_stream_ends_that_stream_cleanly_and_nothing_else(model, monkeypatch):
    """A bug behind a stream that has started (its 200 is out): an error event and [DONE] where the
    bug is in making the events, a cut connection where it is in writing them; never a second response
    on the same connection. The requests' sequences are aborted and the gateway serves on."""
    import asyncio

    import aiohttp

    import gateway.server as gs
    from moemesh.entrypoints.launcher import LocalMesh
    from moemesh.settings import EngineSettings, GatewaySettings

    made = {"deltas": 0}
    real_delta, real_chat_delta = gs.Delta, gs.Gateway._chat_delta

    def failing_delta(*args, **kwargs):
        made["deltas"] += 1
        if made.get("fail_delta") and made["deltas"] == 3:
            raise RuntimeError("a bug making events")
        return real_delta(*args, **kwargs)

    def failing_chat_delta(self, *args, **kwargs):
        if made.get("fail_write"):
            raise RuntimeError("a bug writing events")
        return real_chat_delta(self, *args, **kwargs)

    monkeypatch.setattr(gs, "Delta", failing_delta)
    monkeypatch.setattr(gs.Gateway, "_chat_delta", failing_chat_delta)

    async def scenario():
        with LocalMesh.of(EngineSettings(model=str(model), kv_memory=4 << 20)) as mesh:
            ready, urls = asyncio.Event(), []
            server = asyncio.ensure_future(gs.run_gateway(GatewaySettings(coordinator=mesh.client_address, port=0),
                                                          ready, urls))
            try:
                await asyncio.wait_for(ready.wait(), 120)
                async with aiohttp.ClientSession() as session:
                    async def stream(path, body):
                        raw = b""
                        async with session.post(urls[0] + path, json={**body, "stream": True}) as r:
                            try:
                                async for chunk in r.content.iter_any():
                                    raw += chunk
                            except aiohttp.ClientPayloadError:
                                raw += b"<cut>"
                            return r.status, raw

                    body = {"prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True}
                    made["fail_delta"] = True
                    events = await stream("/v1/completions", body)
                    made["fail_delta"], made["fail_write"] = False, True
                    cut = await stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 20, "ignore_eos": True})
                    made["fail_write"] = False
                    async with session.post(urls[0] + "/v1/completions", json=body) as r:
                        after = r.status, await r.json()
                    for _ in range(50):  # (/metrics shows the coordinator's status as last polled, twice a second)
                        async with session.get(urls[0] + "/metrics") as r:
                            metrics = await r.text()
                        if re.search(r"^vllm:num_requests_running\S* 0\.0$", metrics, re.M):
                            break
                        await asyncio.sleep(0.1)
            finally:
                server.cancel()
                await asyncio.gather(server, return_exceptions=True)
        return events, cut, after, metrics

    (status, raw), (cut_status, cut_raw), after, metrics = asyncio.run(scenario())
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n"), raw
    error = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {\"error")]
    assert error and error[0]["error"]["code"] == 500 and "RuntimeError" in error[0]["error"]["message"]
    assert cut_status == 200 and b"[DONE]" not in cut_raw and b"HTTP/1.1" not in cut_raw, cut_raw
    assert after[0] == 200 and len(after[1]["choices"][0]["text"]) > 0
    assert re.search(r"^vllm:num_requests_running\S* 0\.0$", metrics, re.M), metrics


def test_tokenizer_endpoints_round_trip(server):
    status, body, _ = http("GET", f"{server.url}/tokenizer_info")
    info = json.loads(body)
    assert status == 200 and info["eos_token"] == "<|endoftext|>"
    text = "Héllo, wörld! 🙂"
    ids = json.loads(http("POST", f"{server.url}/tokenize", {"prompt": text, "add_special_tokens": False})[1])["tokens"]
    assert json.loads(http("POST", f"{server.url}/detokenize", {"tokens": ids})[1])["prompt"] == text
    for path in ("/v1/models", "/version", "/health"):
        assert http("GET", server.url + path)[0] == 200


def test_the_open_tokenizer_routes_refuse_more_than_a_context_before_the_work(server):
    """/detokenize and /tokenize need no API key (as vLLM's): more ids, or more chat messages, than the
    context holds are a 400 at once, not seconds of the event loop every stream waits on."""
    context = json.loads(http("GET", f"{server.url}/tokenizer_info")[1])["model_max_length"]
    status, body, _ = http("POST", f"{server.url}/detokenize", {"tokens": [5] * (context + 1)})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    assert "context" in json.loads(body)["error"]["message"]
    assert http("POST", f"{server.url}/detokenize", {"tokens": [5] * context})[0] == 200
    many = [{"role": "user", "content": ""}] * (context + 1)
    status, body, _ = http("POST", f"{server.url}/tokenize", {"messages": many})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"
    assert "messages" in json.loads(body)["error"]["message"]
    assert http("POST", f"{server.url}/tokenize", {"messages": many[:2]})[0] == 200
    # a template of the request's own is refused here as /v1/chat/completions refuses it, not ignored
    status, body, _ = http("POST", f"{server.url}/tokenize", {"messages": many[:2], "chat_template": "{{ 1 }}"})
    assert status == 400 and json.loads(body)["error"]["param"] == "chat_template"


def test_debug_timeline_shows_each_stage_and_the_coordinator_step_by_step(server):
    """/debug/timeline: a trace file with a row per stage and one for the coordinator, in which a
    step runs on stage 0, then on stage 1, inside the coordinator's span for it."""
    assert http("POST", f"{server.url}/v1/completions", {"prompt": "x", "max_tokens": 4, "ignore_eos": True})[0] == 200
    deadline = time.monotonic() + 15
    while True:  # (the stages' spans come with their heartbeats, every 0.5 s: later on a loaded machine)
        time.sleep(0.6)
        status, body, _ = http("GET", f"{server.url}/debug/timeline")
        assert status == 200
        events = json.loads(body)["traceEvents"]
        steps = {}  # step -> tid -> (start, end) in microseconds
        for e in events:
            if e["ph"] == "X":
                steps.setdefault(e["name"], {})[e["tid"]] = (e["ts"], e["ts"] + e["dur"])
                assert e["args"]["tokens"] >= e["args"]["seqs"] >= 1
        whole = [s for s in steps.values() if len(s) == 3]
        if len(whole) >= 4 or time.monotonic() > deadline:
            break
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "coordinator (schedule out -> result taken)"}
    assert len(whole) >= 4  # the request's prompt and its decodes
    slack = 2000  # (wall-clock starts, durations from another clock: within a couple of milliseconds)
    for s in whole:
        assert s[0][1] <= s[1][0] + slack and s[2][0] <= s[0][0] + slack and s[1][1] <= s[2][1] + slack


def metric(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = http("GET", f"{server.url}/metrics")[1].decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_recovery_counters_survive_a_new_coordinator_and_silence_unfreezes_the_gauges():
    """The coordinator's running totals (recoveries, restarts, refusals, malformed messages) are
    counters: a coordinator started afresh counts from zero, the gateway's series go on. While no
    status comes, the gauges say the gateway's own requests, not the last status frozen."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.metrics import Metrics
    from moemesh.protocol import StatusReply

    def status(instance, recoveries, running=3):
        return StatusReply(True, 8, 4, running, 2, 0, [0.0], [0.0], 1.0, recoveries, instance=instance,
                           recoveries=recoveries, workers_replaced=recoveries)

    def sample(m, name):
        text = generate_latest(m.registry).decode()
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    m = Metrics("m")
    m.update_from_status(status("a", 1), 1.0)
    m.update_from_status(status("b", 0), 2.0)  # (a coordinator started afresh)
    m.update_from_status(status("b", 2), 3.0)
    for name in ("moemesh:recoveries_total", "moemesh:worker_restarts_total", "moemesh:malformed_messages_total"):
        assert sample(m, name) == 3, name
    assert (sample(m, "vllm:num_requests_running"), sample(m, "vllm:kv_cache_usage_perc")) == (3, 0.5)
    m.coordinator_silent(streams=1)
    assert (sample(m, "vllm:num_requests_running"), sample(m, "vllm:num_requests_waiting"),
            sample(m, "vllm:kv_cache_usage_perc")) == (1, 0, 0)


def test_metrics_move_and_a_disconnect_frees_the_request(server, client):
    text = http("GET", f"{server.url}/metrics")[1].decode()  # every series there from the start, as vLLM's
    assert all(f'finished_reason="{reason}"' in text for reason in ("stop", "length", "abort", "error"))
    before = metric(server, "vllm:generation_tokens_total")
    latencies = [metric(server, name) for name in ("vllm:e2e_request_latency_seconds_count",
                                                   "vllm:time_to_first_token_seconds_count")]
    client.completions.create(model="tiny-mixtral", prompt="count", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(server, "vllm:generation_tokens_total") == before + 5
    assert metric(server, "vllm:time_to_first_token_seconds_count") >= 1
    # a streaming client that goes away: its request is aborted and its blocks come back
    conn = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "a long one", "max_tokens": 240, "stream": True, "ignore_eos": True}).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"data:" not in received:
        chunk = conn.recv(4096)
        assert chunk, "the server closed the stream"
        received += chunk
    conn.close()  # (at its first token: 239 more to go)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (metric(server, "vllm:num_requests_running") or
                                           metric(server, "vllm:kv_cache_usage_perc")):
        time.sleep(0.2)
    assert metric(server, "vllm:num_requests_running") == 0 and metric(server, "vllm:kv_cache_usage_perc") == 0
    # the aborted request is counted as vLLM counts it: finished_reason="abort", its tokens and latency included
    while time.monotonic() < deadline and not metric(server, "vllm:request_success_total", finished_reason="abort"):
        time.sleep(0.1)  # (the gateway counts it as its handler unwinds)
    assert metric(server, "vllm:request_success_total", finished_reason="abort") >= 1
    assert before + 5 < metric(server, "vllm:generation_tokens_total") < before + 5 + 240
    # (each of its two requests had a first token, and a latency)
    assert metric(server, "vllm:e2e_request_latency_seconds_count") == latencies[0] + 2
    assert metric(server, "vllm:time_to_first_token_seconds_count") == latencies[1] + 2
    assert "vllm:num_preemptions_total" in http("GET", f"{server.url}/metrics")[1].decode()  # (a counter, as vLLM's)


def test_a_cache_salt_keeps_a_prompt_from_other_tenants_prefix_cache(server, client):
    """vLLM's cache_salt on completions, chat and responses: a salted prompt finds nothing another salt
    (or none) cached, and finds what its own salt cached; an empty salt is a 400 naming it."""
    import openai

    prompt = "a prompt two tenants send alike, long enough for blocks " * 6
    kw = dict(model="tiny-mixtral", prompt=prompt, max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text  # (unsalted: now cached)

    def cached(salt):
        r = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "cache_salt": salt}})
        assert r.choices[0].text == text  # (greedy: the same tokens whichever blocks served the prefix)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-1-" + "x" * 40) == 0
    assert cached("tenant-2-" + "y" * 40) == 0
    assert cached("tenant-1-" + "x" * 40) >= 16
    chat = dict(model="tiny-mixtral", messages=[{"role": "user", "content": prompt}], max_tokens=2, temperature=0)
    client.chat.completions.create(**chat, extra_body={"cache_salt": "s1"})
    again = client.chat.completions.create(**chat, extra_body={"cache_salt": "s1"})
    other = client.chat.completions.create(**chat, extra_body={"cache_salt": "s2"})
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 and other.usage.prompt_tokens_details.cached_tokens == 0
    asked = {"model": "tiny-mixtral", "input": prompt, "max_output_tokens": 2}
    for salt, want_cached in ((None, False), ("s3", False), ("s3", True)):  # (the unsalted one is cached first)
        status, body, _ = http("POST", f"{server.url}/v1/responses", {**asked, **({"cache_salt": salt} if salt else {})})
        assert status == 200, body
        assert bool(json.loads(body)["usage"]["input_tokens_details"]["cached_tokens"]) == want_cached, (salt, body)
    beam = {**kw, "n": 2, "extra_body": {"use_beam_search": True}}  # each beam step under the request's salt
    for salt, want_cached in ((None, True), ("s4", False), ("s4", True)):
        r = client.completions.create(**{**beam, "extra_body": {"use_beam_search": True,
                                                                 **({"cache_salt": salt} if salt else {})}})
        assert bool(r.usage.prompt_tokens_details.cached_tokens) == want_cached, (salt, r.usage)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**kw, "extra_body": {"cache_salt": ""}})
    assert e.value.body["param"] == "cache_salt"


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client):
    prompt = "a prompt the prefix cache keeps " * 8  # several full 16-token blocks
    kw = dict(model="tiny-mixtral", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    time.sleep(1.2)  # the counters follow the coordinator's status, polled: let them catch up first
    hits, queries = metric(server, "vllm:prefix_cache_hits_total"), metric(server, "vllm:prefix_cache_queries_total")
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text
    want = (hits + second.usage.prompt_tokens_details.cached_tokens, queries + 2 * first.usage.prompt_tokens)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(server, "vllm:prefix_cache_queries_total") < want[1]:
        time.sleep(0.2)
    assert metric(server, "vllm:prefix_cache_hits_total") == want[0]
    assert metric(server, "vllm:prefix_cache_queries_total") == want[1]


def test_api_key_429_a_recovered_worker_and_a_dead_coordinator(model):
    server = Server(model, "--api-key", "sesame", "--max-pending", "2", "--coordinator-timeout", "4")
    try:
        url = f"{server.url}/v1/completions"
        status, body, _ = http("POST", url, {"prompt": "x"})
        assert status == 401 and json.loads(body)["error"]["code"] == 401
        assert http("GET", f"{server.url}/debug/timeline")[0] == 401
        auth = {"Authorization": "Bearer sesame"}
        assert http("POST", url, {"prompt": "x", "max_tokens": 2}, auth)[0] == 200
        # Anthropic's clients send x-api-key; its errors are Anthropic's shape on /v1/messages
        anthropic_body = {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
        assert http("POST", f"{server.url}/v1/messages", anthropic_body, {"x-api-key": "sesame"})[0] == 200
        status, body, _ = http("POST", f"{server.url}/v1/messages", anthropic_body, {"x-api-key": "open"})
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        results = []
        threads = [threading.Thread(target=lambda: results.append(http(
            "POST", url, {"prompt": "x", "max_tokens": 200, "ignore_eos": True}, auth))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        limited = [r for r in results if r[0] == 429]
        assert limited and all(r[2].get("Retry-After") == "1" for r in limited)
        assert sum(r[0] == 200 for r in results) >= 1
        # a stage worker dies (once the request's first tokens have streamed: it is surely in flight): it is
        # restarted, the pipeline recovers, the request completes
        chunks = _stream_killing(server, url, auth, {"prompt": "x", "max_tokens": 250, "ignore_eos": True,
                                                    "stream_options": {"include_usage": True}}, b"stage-worker")
        assert all("error" not in c for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 250
        assert http("GET", f"{server.url}/health")[0] == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and http("GET", f"{server.url}/ready")[0] != 200:
            time.sleep(0.2)
        assert json.loads(http("GET", f"{server.url}/ready")[1]) == {"ready": True, "pipeline": "serving"}
        while time.monotonic() < deadline and metric(server, "moemesh:recoveries_total") < 1:
            time.sleep(0.2)
        assert metric(server, "moemesh:recoveries_total") == 1
        assert metric(server, "moemesh:requests_resumed_total") >= 1
        assert metric(server, "moemesh:worker_restarts_total") == 1
        # the coordinator dies while a request streams (its first tokens have arrived, so it cannot be sent
        # again unseen): it ends with an error, /ready turns 503; `serve` starts the coordinator again on the
        # same ports, the workers (hearing nothing) exit, are started again and register with it, and the
        # gateway serves new requests without a restart. (A request of which nothing had arrived would be
        # sent again to the new coordinator and complete: the kill waits for tokens so that this is not it.)
        chunks = _stream_killing(server, url, auth, {"prompt": "x", "max_tokens": 250, "ignore_eos": True},
                                 b"\x00coordinator\x00")
        assert chunks[0]["choices"][0]["text"] is not None and "error" not in chunks[0]
        assert chunks[-1]["error"]["code"] == 503, chunks[-1]
        assert sum(len(c.get("choices") or []) for c in chunks) < 250
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and http("GET", f"{server.url}/ready")[0] != 200:
            time.sleep(0.2)
        assert http("GET", f"{server.url}/ready")[0] == 200
        status, body, _ = http("POST", url, {"prompt": "x", "max_tokens": 3, "ignore_eos": True}, auth)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
    finally:
        server.stop()


def _stream_killing(server, url, auth, body, marker: bytes) -> list[dict]:
    """Streams a completion and SIGKILLs the server's child whose command line holds `marker` while the
    request is surely in flight: once its first event is read, the stage workers are frozen (SIGSTOP), and
    the kill comes only if the coordinator still counts the request as running (a tiny model can finish
    all its tokens before a loaded machine gets to the kill; then the workers go on and it tries again).
    The stream's JSON events."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **auth})
    for _ in range(5):
        with urllib.request.urlopen(request, timeout=60) as r:
            events = [r.readline()]
            workers = [p for p in _children(server.proc.pid) if b"stage-worker" in _cmdline(p)]
            _signal(workers, signal.SIGSTOP)
            try:
                time.sleep(1.0)  # (the gateway asks the coordinator every 0.5 s: a status from the frozen time)
                if metric(server, "vllm:num_requests_running") >= 1:
                    os.kill([p for p in _children(server.proc.pid) if marker in _cmdline(p)][0], signal.SIGKILL)
                    in_flight = True
                else:
                    in_flight = False
            finally:
                _signal(workers, signal.SIGCONT)
            events += r.read().splitlines()
        if in_flight:
            return [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    raise AssertionError("every request finished before the kill")


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _children(pid):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


def _cmdline(pid) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_bench_serve_prints_rows_and_plots(server, tmp_path, capsys):
    from moemesh.entrypoints.cli import main

    png = tmp_path / "curve.png"
    assert main(["bench", "serve", "--url", server.url, "--concurrency", "1,4", "--num-prompts", "4",
                 "--prompt-len", "5", "--new", "3", "--vocab", "600", "--json", "--plot", str(png)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["failed"] == 0 and r["requests"] == 4 and r["output_tok_per_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_mean_ms"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_silent_coordinator_is_down_at_once_and_its_requests_wait_for_it(monkeypatch):
    """Silence: /health's status says down from the first unanswered poll, but the requests in flight
    go on (a stalled coordinator still holds them) until COORDINATOR_LOST seconds have passed; a
    mesh its launcher gave up on keeps that reason, not "does not answer". (A clock of the test's
    own: each unanswered poll takes 2.5 s on it, the status timeout and the pause after.)"""
    import asyncio
    import types

    import gateway.server as gs
    import moemesh
    from moemesh.protocol import StatusReply
    from moemesh.settings import GatewaySettings

    clock = [0.0]
    monkeypatch.setattr(gs, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(gs, "COORDINATOR_LOST", 10.0)

    class Silent:
        def __init__(self, answers_at=()):
            self.streams, self.failed = {"r1": None}, []  # failed: (clock, error)
            self.answers_at = answers_at  # clock times it answers at (the same coordinator)

        async def status(self, timeout):
            clock[0] += 2.5
            if clock[0] in self.answers_at:
                return StatusReply(True, 8, 8, 1, 0, 0, [0.0], [0.0], 1.0, 0, instance="a")
            raise asyncio.TimeoutError

        def fail_all(self, error):
            self.failed.append((clock[0], error))
            self.streams = {}

    async def scenario(down=None, answers_at=(), until=15):
        gateway = gs.Gateway(GatewaySettings(model=str(Path(moemesh.__file__).parent / "demo_model")))
        gateway.client, gateway.down, gateway._stopping = Silent(answers_at), down, False
        gateway.status = StatusReply(True, 8, 8, 1, 0, 0, [0.0], [0.0], 1.0, 0, instance="a")
        gateway.max_model_len = 0
        gateway.metrics = types.SimpleNamespace(update_from_status=lambda *a: None, coordinator_silent=lambda *a: None)
        poller = asyncio.ensure_future(gateway._poll_status())
        while clock[0] < until:
            await asyncio.sleep(0.05)
        poller.cancel()
        return gateway.status, gateway.client.failed

    status, failed = asyncio.run(scenario())
    assert not status.serving and status.failure == "the coordinator does not answer"
    refusal = types.SimpleNamespace(status=status, down=None)  # (its 503 says when to try again; a mesh given up on's not)
    assert gs.Gateway._not_serving(refusal).headers == {"Retry-After": "5"}
    assert "Retry-After" not in gs.Gateway._not_serving(types.SimpleNamespace(status=status, down="gone")).headers
    # (silent from the first poll, at 2.5: requests end at the first poll 10 s on, not before)
    assert failed == [(12.5, "the coordinator does not answer")]
    clock[0] = 0.0
    status, failed = asyncio.run(scenario(down="stage worker pp=1 past its restart budget"))
    assert status.failure == "stage worker pp=1 past its restart budget"
    assert failed == [(12.5, "stage worker pp=1 past its restart budget")]
    # silent from 2.5, answering at 7.5 (the same coordinator), silent again from 10: the requests
    # wait 10 s from the second silence, not from the first
    clock[0] = 0.0
    status, failed = asyncio.run(scenario(answers_at=(7.5,), until=22.5))
    assert failed == [(20.0, "the coordinator does not answer")]


def test_a_lost_coordinator_ends_requests_instead_of_hanging(model):
    server = Server(model, "--max-waiting", "4")
    try:
        # (first: a request of more sequences than the coordinator queues is a 400, not a 429 retried forever)
        status, body, _ = http("POST", f"{server.url}/v1/completions", {"prompt": ["x"] * 5, "max_tokens": 1})
        assert status == 400 and "--max-waiting" in json.loads(body)["error"]["message"], body
        assert http("POST", f"{server.url}/v1/completions", {"prompt": ["x"] * 4, "max_tokens": 1})[0] == 200
        coordinator = [p for p in _children(server.proc.pid) if b" coordinator" in _cmdline(p).replace(b"\0", b" ")]
        assert len(coordinator) == 1
        conn = socket.create_connection(("127.0.0.1", server.port), timeout=60)  # (past COORDINATOR_LOST)
        body = json.dumps({"prompt": "x", "max_tokens": 250, "stream": True, "ignore_eos": True}).encode()
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data:" not in received:
            received += conn.recv(4096)
        os.kill(coordinator[0], signal.SIGKILL)  # mid-stream
        while b"[DONE]" not in received:
            chunk = conn.recv(65536)
            assert chunk, "the stream closed without ending"
            received += chunk
        conn.close()
        assert b'"error"' in received and b"coordinator" in received  # ended with an error event, not a hang
        assert http("GET", f"{server.url}/health")[0] == 503
    finally:
        server.stop()


def test_a_client_that_stops_reading_is_cut_off_and_others_keep_their_pace(model):
    """A streaming client that stops reading (its socket's buffers full): its request is aborted
    after --stream-timeout, its KV blocks are freed, and a stream beside it runs undisturbed. One
    that stops sending its body gets a 408; one whose headers do not arrive, or that sits idle, is
    closed after --keepalive-timeout."""
    server = Server(model, "--pp", "2", "--stream-timeout", "2", "--keepalive-timeout", "3")
    try:
        sleeper = socket.socket()
        sleeper.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: a tiny window
        sleeper.connect(("127.0.0.1", server.port))
        body = json.dumps({"prompt": "x", "max_tokens": 240, "n": 16, "logprobs": 20, "stream": True,
                           "ignore_eos": True}).encode()
        sleeper.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        started = time.monotonic()
        # beside it, a reader that reads: its stream completes in full
        other = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        text_tokens = 0
        for chunk in other.completions.create(model="tiny-mixtral", prompt="y", max_tokens=40, stream=True,
                                              temperature=0, extra_body={"ignore_eos": True}):
            text_tokens += 1
        assert text_tokens >= 40
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and metric(server, "moemesh:slow_clients_aborted_total") < 1:
            time.sleep(0.2)
        assert metric(server, "moemesh:slow_clients_aborted_total") == 1
        assert time.monotonic() - started < 40  # bounded: not the 16 x 240 tokens it asked for
        while time.monotonic() < deadline and metric(server, "vllm:num_requests_running") > 0:
            time.sleep(0.2)
        assert metric(server, "vllm:num_requests_running") == 0
        assert metric(server, "vllm:kv_cache_usage_perc") == 0  # its blocks are back in the pool
        sleeper.close()
        assert http("GET", f"{server.url}/ready")[0] == 200
        # one that leaves (a reset) while the gateway waits to write to it: aborted, and no error logged
        # (aiohttp says "Connection lost", a ConnectionError that is no ConnectionResetError)
        leaver = socket.socket()
        leaver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        leaver.connect(("127.0.0.1", server.port))
        leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(1.0)
        leaver.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        leaver.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and metric(server, "vllm:num_requests_running") > 0:
            time.sleep(0.2)
        assert metric(server, "vllm:num_requests_running") == 0
        assert metric(server, "moemesh:slow_clients_aborted_total") == 1
        # one that stops sending its body (a slowloris): a 408 after --stream-timeout, not a handler held
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        started, answer = time.monotonic(), b""
        while b"\r\n\r\n{" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = slow.recv(4096)
            if not chunk:
                break
            answer += chunk
        slow.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"--stream-timeout" in answer, answer
        assert 1.5 < time.monotonic() - started < 20
        # one that sends a byte now and then, each within --stream-timeout: a 408 once 4 x 2 s have passed
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        started, answer = time.monotonic(), b""
        slow.settimeout(1.0)
        while not answer and time.monotonic() - started < 20:
            try:
                slow.sendall(b" ")
                answer = slow.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
        slow.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert 7.5 < time.monotonic() - started < 12
        # headers that never end, a byte now and then, and a connection that sends nothing: closed once
        # --keepalive-timeout has passed since they connected (aiohttp's own limit is an hour)
        trickle, idle = (socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(2))
        started, closed = time.monotonic(), {}
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        trickle.settimeout(0.5)
        idle.settimeout(0.5)
        while len(closed) < 2 and time.monotonic() - started < 20:
            for name, conn in (("trickle", trickle), ("idle", idle)):
                if name in closed:
                    continue
                try:
                    if name == "trickle":
                        conn.sendall(b"X-Slow: 1\r\n")
                    if conn.recv(4096) == b"":
                        closed[name] = time.monotonic() - started
                except socket.timeout:
                    continue
                except OSError:
                    closed[name] = time.monotonic() - started
        trickle.close()
        idle.close()
        assert set(closed) == {"trickle", "idle"} and all(2.5 < t < 6 for t in closed.values()), closed
        # clients that leave while sending a body (closed, and reset): nothing to answer, nothing logged
        for reset in (False, True):
            gone = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            gone.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\":")
            time.sleep(0.3)
            if reset:
                gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            gone.close()
        time.sleep(0.5)
        assert http("GET", f"{server.url}/ready")[0] == 200
    finally:
        _, err = server.stop()
    assert b"request failed mid-stream" not in err and b"Traceback" not in err, err[-3000:]
    assert b"Error handling request" not in err, err[-3000:]


def _rss(pid) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.slow
def test_256_streams_for_60_s_without_an_error_or_a_leak(model):
    """A soak: 256 streaming clients, each sending requests back to back for 60 s (after 10 s of
    warm-up), through the gateway and a two-stage mesh. No request fails, and no process (gateway,
    coordinator, workers) grows by more than 10% from its size after the warm-up."""
    import asyncio

    import aiohttp

    server = Server(model, "--pp", "2", "--max-pending", "4096")
    procs = [server.proc.pid, *_children(server.proc.pid)]
    counts = {"ok": 0, "errors": []}

    async def client(session, i, until):
        while time.monotonic() < until:
            body = {"prompt": [5 + i % 50, 6, 7 + i % 13], "max_tokens": 24, "stream": True, "ignore_eos": True,
                    "temperature": 0.8, "seed": i}
            async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    counts["errors"].append(resp.status)
                    continue
                text = (await resp.read()).decode()
                if '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
                    counts["errors"].append(text[-200:])
                else:
                    counts["ok"] += 1

    async def soak(seconds):
        until = time.monotonic() + seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*(client(session, i, until) for i in range(256)))

    try:
        asyncio.run(soak(10))
        warm = {p: _rss(p) for p in procs}
        done_warm = counts["ok"]
        asyncio.run(soak(60))
        after = {p: _rss(p) for p in procs}
        assert counts["errors"] == [] and counts["ok"] - done_warm > 256
        names = {p: " ".join(part.decode() for part in _cmdline(p).split(bytes(1))[2:4]) for p in procs}
        grown = {f"{names[p]} (pid {p})": round(after[p] / warm[p], 3) for p in procs if warm[p]}
        print(f"soak: {counts['ok'] - done_warm} requests in 60 s, RSS after / after warm-up: {grown}")
        assert all(r <= 1.10 for r in grown.values()), grown
        assert len(grown) == 4  # serve (the gateway), the coordinator, two workers
    finally:
        server.stop()


def test_an_echo_keeps_the_prompts_special_tokens_and_offsets_follow_the_text(server):
    prompt = "def f(x):<|im_end|>\nreturn"
    r = json.loads(http("POST", f"{server.url}/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                                "echo": True, "logprobs": 0})[1])["choices"][0]
    assert r["text"].startswith(prompt)
    lp = r["logprobs"]
    n = len(lp["tokens"]) - 1  # the prompt's tokens
    assert "".join(lp["tokens"][:n]) == prompt
    assert lp["text_offset"][:n + 1] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n + 1)]


def test_prompt_logprobs_are_vllms_shape_and_transformers_values(model, server):
    """vLLM's prompt_logprobs: per prompt position null (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt's token first with its rank in the vocabulary, then its top N; on every
    completion choice, beside the choices of a chat completion; an echo's logprobs beside them keep
    their own N; refused in a stream and out of range."""
    import torch
    from transformers import AutoModelForCausalLM

    from moemesh.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def check(plp, ids, k):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
        assert len(plp) == len(ids) and plp[0] is None
        for pos in range(1, len(ids)):
            row, token, at = ref[pos - 1], ids[pos], plp[pos]
            top = row.topk(k)
            assert list(at)[0] == str(token)
            assert set(at) == {str(token), *map(str, top.indices.tolist())}
            mine = at[str(token)]
            assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            # (the tokens at least as likely, itself included; a tolerance for near-ties between two
            # float computations)
            assert (int((row >= row[token] + 1e-4).sum()) + 1 <= mine["rank"]
                    <= int((row >= row[token] - 1e-4).sum())), (pos, mine)
            assert mine["decoded_token"] == tok.token_label(token)
            for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                assert at[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
                if t != token:
                    assert at[str(t)]["rank"] == rank and at[str(t)]["decoded_token"] == tok.token_label(t)

    url = f"{server.url}/v1/completions"
    prompt = "The quick brown fox jumps over"
    ids = tok.encode(prompt)
    status, raw, _ = http("POST", url, {"prompt": prompt, "max_tokens": 2, "temperature": 0, "n": 2,
                                        "prompt_logprobs": 3, "echo": True, "logprobs": 1})
    assert status == 200, raw
    choices = json.loads(raw)["choices"]
    assert len(choices) == 2
    for c in choices:
        check(c["prompt_logprobs"], ids, 3)
        # the echo's logprobs come from the same computation and show their own one alternative
        lp = c["logprobs"]
        assert all(len(t) <= 2 for t in lp["top_logprobs"][1:len(ids)])
        assert lp["token_logprobs"][1:len(ids)] == [c["prompt_logprobs"][p][str(ids[p])]["logprob"]
                                                    for p in range(1, len(ids))]
    plain = json.loads(http("POST", url, {"prompt": prompt, "max_tokens": 1})[1])["choices"][0]
    assert "prompt_logprobs" not in plain  # (only where asked)

    chat = f"{server.url}/v1/chat/completions"
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = json.loads(http("POST", f"{server.url}/tokenize", {"messages": messages})[1])["tokens"]
    status, raw, _ = http("POST", chat, {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200, raw
    body = json.loads(raw)
    check(body["prompt_logprobs"], ids, 0)
    assert "prompt_logprobs" not in body["choices"][0]

    for bad in [{"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}]:
        for where, request in [(url, {"prompt": "x", **bad}), (chat, {"messages": messages, **bad})]:
            status, raw, _ = http("POST", where, request)
            assert status == 400 and json.loads(raw)["error"]["param"] == "prompt_logprobs", (bad, raw)


def _bytes_of(label: str) -> bytes:
    """A logprobs token name back to its bytes ("bytes:\\xNN..." or text)."""
    if label.startswith("bytes:"):
        return bytes(int(h, 16) for h in label[len("bytes:"):].split("\\x")[1:])
    return label.encode()


def test_logprobs_name_pieces_of_characters_by_their_bytes_and_offsets_count_whole_characters(model, server):
    """A character split across tokens (an emoji's four bytes, an accent's two): each piece is named
    "bytes:\\xNN" (OpenAI's way), the names' bytes join up to the text, and each token's text_offset
    is where its character starts in the returned text, streamed or not; a token-id prompt that ends
    inside a character echoes up to it, and the generated text starts with it whole."""
    from moemesh.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    prompt = "é café 🎉 ok"
    assert any(len(tok.token_bytes(t)) < len(tok.token_text(t).encode()) for t in tok.encode(prompt))  # (split)
    url = f"{server.url}/v1/completions"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2, "ignore_eos": True}
    r = json.loads(http("POST", url, body)[1])["choices"][0]
    lp, text = r["logprobs"], r["text"]
    n = len(tok.encode(prompt))
    assert text.startswith(prompt) and b"".join(_bytes_of(t) for t in lp["tokens"][:n]) == prompt.encode()
    for i, (name, at) in enumerate(zip(lp["tokens"], lp["text_offset"])):
        if name.startswith("bytes:"):  # (where its character starts: one whose bytes hold it, or an invalid one)
            assert text[at] == "\ufffd" or _bytes_of(name)[0] in text[at].encode(), (i, name, at)
        else:
            assert text[at:at + len(name)] == name, (i, name, at)
    # the prompt's: the whole characters before each token's first byte
    starts = [len(b"".join(_bytes_of(t) for t in lp["tokens"][:i])) for i in range(n)]
    assert lp["text_offset"][:n] == [len(prompt.encode()[:p].decode(errors="ignore")) for p in starts]
    # top_logprobs keys are names too: each position's own token among them
    assert all(name in top for name, top in zip(lp["tokens"][n:], lp["top_logprobs"][n:]))
    events = _sse(url, {**body, "stream": True})
    chunks = [c for e in events for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == text
    assert sum((c["logprobs"]["text_offset"] for c in chunks), []) == lp["text_offset"]
    assert sum((c["logprobs"]["tokens"] for c in chunks), []) == lp["tokens"]

    ids = tok.encode("🎉🎉🎉🎉", add_special_tokens=False)[:-2]  # (ends inside the last emoji)
    r = json.loads(http("POST", url, {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True,
                                      "ignore_eos": True})[1])["choices"][0]
    generated = engine_greedy(model, ids, 3)
    assert r["text"] == tok.decode(ids + generated, skip_special_tokens=False)


def test_text_offsets_carry_a_split_character_from_chunk_to_chunk(model, monkeypatch):
    """A stream's chunks carry where the text stands, a character's first bytes included: one token a
    chunk gives the offsets of all at once; the generated tokens count from the echo as returned (a
    text prompt's echo is the text sent, which its tokens need not spell out); an empty --api-key
    falls back on MOEMESH_API_KEY."""
    from gateway.server import Gateway, TextAt
    from moemesh.protocol import TokenLogprobs
    from moemesh.settings import GatewaySettings
    from moemesh.tokenizer import TextTokenizer

    monkeypatch.setenv("MOEMESH_API_KEY", "secret")
    gateway = Gateway(GatewaySettings(model=str(model), api_key=""))
    assert gateway.api_keys  # (the variable's key, not none)
    tok = gateway.tokenizer = TextTokenizer(model)  # (what start() loads once the pipeline serves)
    ids = tok.encode("é café 🎉 ok 日本", add_special_tokens=False)
    lps = [TokenLogprobs(t, -1.0, []) for t in ids]
    whole, end = gateway._completion_logprobs(lps, None, None)
    offsets, at = [], TextAt()
    for lp in lps:
        part, at = gateway._completion_logprobs([lp], None, None, at)
        offsets += part["text_offset"]
    assert offsets == whole["text_offset"] and at == end and end.offset == len("é café 🎉 ok 日本")
    assert len(set(whole["text_offset"])) < len(ids)  # (pieces of a character share its offset)
    # an echo as sent that its tokens do not spell out: the generated offsets follow the echo
    echoed, _ = gateway._completion_logprobs(lps[-2:], ids[:3], None, None, echo_text="<s>" + tok.decode(ids[:3]))
    assert echoed["text_offset"][3] == 3 + len(tok.decode(ids[:3]))


def test_a_prompt_ending_in_a_replacement_character_of_its_own_is_not_inside_one(model, server):
    """Told by the bytes, not the text: a prompt whose last character is a U+FFFD it holds keeps it in
    the echo, and the generated text does not start with another; one that ends inside a character
    echoes up to it."""
    from moemesh.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    ids = tok.encode("abc\ufffd", add_special_tokens=False)
    assert not tok.ends_inside_character(ids)
    assert tok.ends_inside_character(tok.encode("ab🎉", add_special_tokens=False)[:-1])
    r = json.loads(http("POST", f"{server.url}/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0,
                                                                "echo": True, "ignore_eos": True})[1])["choices"][0]
    assert r["text"] == tok.decode(ids + engine_greedy(model, ids, 3), skip_special_tokens=False)


def test_the_models_generation_config_sets_request_defaults(model, tmp_path):
    """As vLLM's --generation-config auto: temperature (here 0: greedy) and max_new_tokens (a cap) from
    generation_config.json for requests that do not set them; `vllm` keeps the OpenAI defaults; a bad
    value is refused at start, naming the file."""
    import shutil

    from moemesh.config import ConfigError, generation_defaults

    recommended = tmp_path / "tiny-mixtral"
    shutil.copytree(model, recommended)
    config = json.loads((recommended / "generation_config.json").read_text())
    (recommended / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0,
                                                                     "max_new_tokens": 5}))
    assert generation_defaults(recommended) == {"temperature": 0.0, "max_tokens": 5}
    server = Server(recommended)
    try:
        url = f"{server.url}/v1/completions"
        texts = [json.loads(http("POST", url, {"prompt": "Once upon", "max_tokens": 8, "ignore_eos": True,
                                               **extra})[1])["choices"][0]["text"]
                 for extra in ({}, {"temperature": 0}, {"seed": 3})]
        assert texts[0] == texts[1] == texts[2]  # greedy without being told
        r = json.loads(http("POST", url, {"prompt": "Once upon", "ignore_eos": True, "temperature": 1.0, "seed": 1,
                                          "n": 4, "max_tokens": 8})[1])
        assert r["usage"]["completion_tokens"] == 4 * 5 and len({c["text"] for c in r["choices"]}) > 1
        chat = json.loads(http("POST", f"{server.url}/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})[1])
        assert chat["usage"]["completion_tokens"] == 5
        # (the cap, not the context's end, cut Anthropic's answer: its stop_reason says max_tokens)
        message = json.loads(http("POST", f"{server.url}/v1/messages", {
            "model": "tiny-mixtral", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}],
            "ignore_eos": True})[1])
        assert message["usage"]["output_tokens"] == 5 and message["stop_reason"] == "max_tokens"
    finally:
        server.stop()
    (recommended / "generation_config.json").write_text(json.dumps({**config, "top_k": 20.0, "top_p": 0.9}))
    assert generation_defaults(recommended) == {"top_k": 20, "top_p": 0.9}
    (recommended / "generation_config.json").write_text(json.dumps({**config, "top_k": -1}))
    assert generation_defaults(recommended) == {"top_k": 0}
    (recommended / "generation_config.json").write_text(json.dumps({**config, "temperature": "hot"}))
    with pytest.raises(ConfigError, match="generation_config.json"):
        generation_defaults(recommended)


def test_a_stop_string_completed_just_before_the_stop_token_of_a_burst_counts_no_token_after_it(model):
    """An output of several tokens (a --num-scheduler-steps burst, kept drafts) that ends [the token
    completing a stop string, the EOS]: the answer, its usage and its logprobs end at the stop string's
    token, as when the tokens come one an output (the EOS had been counted when the burst held two)."""
    import asyncio
    from unittest.mock import MagicMock

    from gateway.server import Gateway
    from moemesh.protocol import RequestOutput, TokenLogprobs
    from moemesh.sampling import SamplingParams
    from moemesh.tokenizer import TextTokenizer

    tok = TextTokenizer(model)
    tokens = tok.encode("hello world.") + [0]  # (whatever ends it: the last token of a "stop" output)

    class Client:
        def __init__(self, outputs):
            self.outputs = outputs

        def generate(self, prompt, params, request_id=None):
            async def stream():
                start = 0
                for i, ids in enumerate(self.outputs):
                    yield RequestOutput(request_id, ids, [TokenLogprobs(t, -1.0, []) for t in ids],
                                        finish_reason="stop" if i == len(self.outputs) - 1 else None,
                                        num_prompt_tokens=3, start=start)
                    start += len(ids)
            return stream()

    def answer(outputs, stop):
        gateway = object.__new__(Gateway)
        gateway.tokenizer, gateway.metrics, gateway.model_name = tok, MagicMock(), "m"
        gateway.client = Client(outputs)
        queue = asyncio.Queue()
        shown = {"stop": stop, "include_stop": False, "skip_special_tokens": True}
        asyncio.run(gateway._run("r", 0, [5, 6, 7], SamplingParams(max_tokens=20), shown, queue))
        items = [queue.get_nowait() for _ in range(queue.qsize())]
        choice = items[-1][2]
        return ("".join(p.text for _, kind, p in items if kind == "delta"), len(choice.token_ids),
                len(choice.logprobs), choice.finish_reason)

    for stop in (["."], ["world"]):
        alone = answer([[t] for t in tokens], stop)
        assert stop[0] not in alone[0] and alone[1] == alone[2] < len(tokens) and alone[3] == "stop", alone
        for cut in (2, 3, len(tokens)):
            assert answer([tokens[:-cut], tokens[-cut:]] if cut < len(tokens) else [tokens], stop) == alone, (stop, cut)


def test_a_choice_the_coordinator_refuses_refuses_the_whole_request_before_any_event(model):
    """n > 1: the choices are the coordinator's requests, each taken or refused (429, its queue full)
    alone. One refused after another's first token had been streamed gave a 200 and then a 429 event;
    nothing goes out now until the coordinator has answered a status asked after every choice went
    out (it answers in order, refusals first), so the refusal is the request's first event (its HTTP
    status). A choice that is taken but begins late (--max-seqs below n) holds nothing up past that."""
    import asyncio
    import time
    from unittest.mock import MagicMock

    from gateway.server import Gateway, HTTPError
    from moemesh.protocol import RequestOutput, TokenLogprobs
    from moemesh.sampling import SamplingParams
    from moemesh.tokenizer import TextTokenizer

    class Client:  # (as the coordinator orders its answers: a refusal before the status asked after it)
        def __init__(self, refuse: bool):
            self.refuse = refuse

        async def status(self, timeout=5.0):
            await asyncio.sleep(0.05)

        def generate(self, prompt, params, request_id=None):
            async def stream():
                if request_id.endswith("-1"):
                    if self.refuse:
                        await asyncio.sleep(0.02)  # (after choice 0's first token, before the status)
                        yield RequestOutput(request_id, [], None, error="the queue is full", error_status=429)
                        return
                    await asyncio.sleep(0.5)  # taken, and begins only when a sequence ends
                for k in range(3):
                    yield RequestOutput(request_id, [5 + k], [TokenLogprobs(5 + k, -1.0, [])],
                                        finish_reason="length" if k == 2 else None, num_prompt_tokens=3, start=k)
            return stream()

    def events(refuse: bool):
        gateway = object.__new__(Gateway)
        gateway.tokenizer, gateway.metrics, gateway.model_name = TextTokenizer(model), MagicMock(), "m"
        gateway.client, gateway._askers, gateway._asking = Client(refuse), [], None
        jobs = [(i, [5, 6, 7], SamplingParams(max_tokens=3)) for i in range(2)]
        shown = {"stop": [], "include_stop": False, "skip_special_tokens": True}

        async def collect():
            got, began = [], time.monotonic()
            try:
                async for item in gateway._gather("r", jobs, shown):
                    got.append((time.monotonic() - began, item))
            except HTTPError as e:
                return got, e.status
            return got, None
        return asyncio.run(collect())

    got, status = events(refuse=True)
    assert (got, status) == ([], 429)
    got, status = events(refuse=False)
    assert status is None and {i for _, (i, kind, _) in got if kind == "done"} == {0, 1}
    assert sum(1 for _, (_, kind, _) in got if kind == "delta") == 6
    assert got[0][0] < 0.3 and got[0][1][0] == 0  # (choice 0's tokens once the coordinator took both)


def test_a_stream_that_waits_gets_its_headers_once_the_coordinator_has_taken_it(model, monkeypatch):
    """A stream's first event decides its HTTP status (a refusal the coordinator answers at once keeps
    it). One whose first token is slow (queued, a long prompt) gets its 200 once the coordinator has
    answered a status asked after it, then a comment line per KEEPALIVE until its first event, so a
    proxy's wait for headers or for bytes does not run out. A refusal answered before that status keeps
    its status, also where the client has read it but the stream's first event is still hops behind
    (the review's race: both in one read); a status that goes unanswered is asked again; with a
    coordinator that answers nothing, and for a beam search (whose later steps may yet be refused), the
    headers wait for the first event."""
    import asyncio
    import time
    from types import SimpleNamespace
    from unittest.mock import MagicMock

    import aiohttp
    from aiohttp import web

    import gateway.server as gs
    from moemesh.protocol import RequestOutput, TokenLogprobs
    from moemesh.sampling import SamplingParams
    from moemesh.tokenizer import TextTokenizer

    monkeypatch.setattr(gs, "HEADERS_AFTER", 0.2)
    monkeypatch.setattr(gs, "KEEPALIVE", 0.15)

    class Client:
        def __init__(self, first_after, refuse=False, status_after=0.02, heard_at=None, unanswered=0):
            self.first_after, self.refuse, self.status_after, self.unanswered = first_after, refuse, status_after, unanswered
            self.heard_at = first_after if heard_at is None else heard_at
            self.aborted, self.began, self.asked = False, time.monotonic(), 0

        def heard(self, request_id):  # (the client has the output: its generate loop may not have taken it yet)
            return time.monotonic() - self.began >= self.heard_at

        async def status(self, timeout=5.0):
            self.asked += 1
            if self.asked <= self.unanswered:
                await asyncio.sleep(0.05)
                raise asyncio.TimeoutError
            await asyncio.sleep(self.status_after)

        def generate(self, prompt, params, request_id=None):
            async def stream():
                self.began = time.monotonic()
                try:
                    await asyncio.sleep(self.first_after)
                    if self.refuse:
                        yield RequestOutput(request_id, [], None, error="the queue is full", error_status=429)
                        return
                    for k in range(2):
                        yield RequestOutput(request_id, [5 + k], [TokenLogprobs(5 + k, -1.0, [])],
                                            finish_reason="length" if k else None, num_prompt_tokens=3, start=k)
                except asyncio.CancelledError:
                    self.aborted = True
                    raise
            return stream()

    async def serve(client, leave_after=None, plan=None, gather=None, chat=False):
        gateway = object.__new__(gs.Gateway)
        gateway.tokenizer, gateway.metrics, gateway.model_name = TextTokenizer(model), MagicMock(), "m"
        gateway.client, gateway.cfg = client, SimpleNamespace(stream_timeout=5.0)
        gateway._askers, gateway._asking = [], None
        if gather is not None:
            gateway._gather = gather
        shown = {"stop": [], "include_stop": False, "skip_special_tokens": True}

        async def write(send_raw, events):
            try:
                async for index, kind, payload in events:
                    await send_raw(f"data: {kind}\n\n".encode())
            except gs.HTTPError as e:
                await send_raw(f"data: error {e.status}\n\n".encode())

        async def handler(request):
            jobs = [(0, [5, 6, 7], SamplingParams(max_tokens=2))]
            try:
                if chat:  # (the chat stream's own writer)
                    body = SimpleNamespace(stream_options=None, logprobs=None, n=1, echo=False)
                    return await gateway._stream(request, body, "r", jobs, shown, True)
                return await gateway._sse(request, "r", jobs, shown, write, plan)
            except gs.HTTPError as e:
                return web.json_response({"error": e.status}, status=e.status)

        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                began = time.monotonic()
                async with session.get(f"http://127.0.0.1:{port}/") as resp:
                    headers_at = time.monotonic() - began
                    if chat:  # -> when the first data line came, and the body
                        first_data, body = None, b""
                        async for line in resp.content:
                            body += line
                            if first_data is None and line.startswith(b"data:"):
                                first_data = time.monotonic() - began
                        return resp.status, headers_at, first_data, body
                    if leave_after is not None:
                        await asyncio.sleep(leave_after)
                        resp.close()
                        for _ in range(30):
                            if client.aborted:
                                break
                            await asyncio.sleep(0.1)
                        return resp.status, headers_at, b""
                    body = await resp.read()
                return resp.status, headers_at, body
        finally:
            await runner.cleanup()

    # (early headers are told by the clock with a wide margin, and by the comment only they send)
    status, headers_at, body = asyncio.run(serve(Client(first_after=2.0)))
    assert status == 200 and headers_at < 1.5, headers_at  # (at 0.2 s and a status round trip, not 2 s)
    assert body.startswith(b": waiting\n\n") and body.count(b": waiting") >= 2
    assert body.endswith(b"data: delta\n\ndata: delta\n\ndata: done\n\n")
    status, headers_at, body = asyncio.run(serve(Client(first_after=0.05)))
    assert status == 200 and b": waiting" not in body  # (a prompt answer: nothing changes)
    status, _, _ = asyncio.run(serve(Client(first_after=0.25, refuse=True, status_after=0.3)))
    assert status == 429  # refused after HEADERS_AFTER, before the status asked after it was answered
    status, _, _ = asyncio.run(serve(Client(first_after=0.5, refuse=True, status_after=0.1, heard_at=0.25)))
    assert status == 429  # read before the status's answer, its first event still on its way
    client = Client(first_after=2.0, unanswered=2)
    status, headers_at, body = asyncio.run(serve(client))
    assert status == 200 and headers_at < 1.5 and client.asked == 3  # (asked until answered)
    assert body.startswith(b": waiting\n\n")
    status, headers_at, body = asyncio.run(serve(Client(first_after=0.8, unanswered=99)))
    assert status == 200 and headers_at >= 0.75 and b": waiting" not in body  # (headers with the first event)

    async def slow_search(rid, jobs, shown, plan):
        await asyncio.sleep(0.8)
        yield 0, "done", None
    status, headers_at, body = asyncio.run(serve(Client(first_after=0.8), plan=SimpleNamespace(search=[object()]),
                                                 gather=slow_search))
    assert status == 200 and headers_at >= 0.75 and b": waiting" not in body  # a beam search: as before
    status, headers_at, first_data, body = asyncio.run(serve(Client(first_after=2.0), chat=True))
    assert status == 200 and headers_at < 1.5 and first_data >= 1.95, (headers_at, first_data)  # (role chunk too)
    assert b'"role": "assistant"' in body and body.endswith(b"data: [DONE]\n\n")
    client = Client(first_after=5.0)
    asyncio.run(serve(client, leave_after=0.2))  # a client that leaves while waiting: its request is aborted
    assert client.aborted


def test_streams_waiting_at_once_share_status_round_trips():
    """Each stream that waits past HEADERS_AFTER needs a status asked after its request: those asking
    while one is on its way share the next, so a burst of queued streams costs the coordinator a few
    answers, not one each; one that stops waiting leaves the others theirs."""
    import asyncio

    from gateway.server import Gateway

    class Client:
        asked = 0

        async def status(self, timeout=5.0):
            Client.asked += 1
            await asyncio.sleep(0.1)

    async def burst():
        gateway = object.__new__(Gateway)
        gateway.client, gateway._askers, gateway._asking = Client(), [], None
        first = [asyncio.ensure_future(gateway._answered_after()) for _ in range(100)]
        await asyncio.sleep(0.05)  # (one on its way: the next hundred share the next one)
        second = [asyncio.ensure_future(gateway._answered_after()) for _ in range(100)]
        second[0].cancel()
        done = await asyncio.gather(*first, *second[1:])
        return done, Client.asked

    done, asked = asyncio.run(burst())
    assert all(done) and asked == 2


def test_echo_shows_the_prompt_as_sent_and_a_stop_string_inside_a_burst_cuts_its_tokens(model, tmp_path):
    """With a tokenizer that adds a BOS, echo shows the text prompt as it was sent (not "<s>..."), and token
    ids as they decode. With --num-scheduler-steps 4 an output carries several tokens: a stop string ends
    the answer at the token that completes it, and the usage and logprobs count no token after it."""
    import shutil

    from moemesh.tokenizer import TextTokenizer

    bos_model = tmp_path / "tiny-mixtral"
    shutil.copytree(model, bos_model)
    tok_json = json.loads((bos_model / "tokenizer.json").read_text())
    tok_json["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    (bos_model / "tokenizer.json").write_text(json.dumps(tok_json))
    tok = TextTokenizer(bos_model)
    prompt = "Once upon a time"
    ids = tok.encode(prompt)
    assert ids[0] == 1  # (the BOS)
    greedy = engine_greedy(bos_model, ids, 24)
    # a stop string that first appears some tokens in: the text one token adds there
    k0 = next(k for k in range(6, 24) if len(piece := tok.decode(greedy[:k])[len(tok.decode(greedy[:k - 1])):]) >= 2
              and piece not in tok.decode(greedy[:k - 1]))
    stop = tok.decode(greedy[:k0])[len(tok.decode(greedy[:k0 - 1])):]
    want = next(k for k in range(1, 25) if stop in tok.decode(greedy[:k]))
    server = Server(bos_model, "--num-scheduler-steps", "4")
    try:
        url = f"{server.url}/v1/completions"
        r = json.loads(http("POST", url, {"prompt": prompt, "max_tokens": 2, "echo": True, "temperature": 0})[1])
        assert r["choices"][0]["text"].startswith(prompt), r
        r = json.loads(http("POST", url, {"prompt": ids, "max_tokens": 2, "echo": True, "temperature": 0})[1])
        assert r["choices"][0]["text"].startswith("<s>" + prompt), r
        chunks = _sse(url, {"prompt": prompt, "max_tokens": 2, "echo": True, "temperature": 0, "stream": True})
        assert chunks[0]["choices"][0]["text"].startswith(prompt), chunks[0]
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop], "logprobs": 0}
        r = json.loads(http("POST", url, body)[1])
        assert r["choices"][0]["text"] == tok.decode(greedy[:want]).split(stop)[0], (r, stop)
        assert r["usage"]["completion_tokens"] == want and len(r["choices"][0]["logprobs"]["tokens"]) == want, r
        chunks = _sse(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert chunks[-1]["usage"]["completion_tokens"] == want
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]) == want
    finally:
        server.stop()


def test_the_gateway_binds_every_address_its_host_names_on_one_port():
    """--host "" (every interface) binds each address family the host has, --port 0 on one port for all;
    nothing listens yet (a client is refused until the pipeline serves); a taken port names the flags."""
    from gateway.server import listen_sockets, start_listening
    from moemesh.errors import ConfigError
    from moemesh.settings import GatewaySettings

    socks = listen_sockets(GatewaySettings(host="", port=0))
    try:
        assert {s.family for s in socks} >= {socket.AF_INET} and len({s.getsockname()[1] for s in socks}) == 1
        port = socks[0].getsockname()[1]
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # (bound, not listening)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(ConfigError, match=f"--port {taken.getsockname()[1]}"):
                listen_sockets(GatewaySettings(host="127.0.0.1", port=taken.getsockname()[1]))
        # two gateways waiting for their pipelines bound one port (neither listened yet): the first to
        # serve takes it, the second's start names the flags (it ended in an AttributeError)
        cfg = GatewaySettings(host="127.0.0.1", port=port)
        first, second = listen_sockets(cfg), listen_sockets(cfg)
        socks += first + second
        start_listening(first, cfg)
        with pytest.raises(ConfigError, match=f"--port {port}: .*another process began listening"):
            start_listening(second, cfg)
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("drain", [None, "0.05"], ids=["default-drain", "short-drain"])
def test_sigterm_stops_serve_once_the_requests_in_flight_have_finished(model, drain):
    """A service manager's stop (`docker stop`, systemd, a pod's deletion) is SIGTERM: `serve` stops
    listening, lets the stream in flight finish within --drain-timeout (5 s), stops its mesh and exits
    0, as on Ctrl-C; a shorter --drain-timeout ends the stream then, with an error event and [DONE] (not
    a connection cut mid-chunk a second drain timeout later)."""
    s = Server(model, "--pp", "2", *(["--drain-timeout", drain] if drain else []))
    try:
        body = {"model": "tiny-mixtral", "prompt": "The quick brown fox", "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"{s.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            first = r.readline()
            assert first.startswith(b"data: "), first
            os.kill(s.proc.pid, signal.SIGTERM)
            events = [first.decode()] + [line.decode() for line in r]
        data = [e[len("data: "):].strip() for e in events if e.startswith("data: ")]
        if drain:
            assert data[-1] == "[DONE]" and len(data) < 100, data[-3:]  # (ended long before its 120 tokens)
            error = json.loads(data[-2])["error"]
            assert "--drain-timeout" in error["message"] and error["code"] == 503, error
            assert s.proc.wait(timeout=30) == 0
            return
        assert data[-1] == "[DONE]", data[-3:]
        chunks = [json.loads(d) for d in data[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert s.proc.wait(timeout=30) == 0
    finally:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.communicate(timeout=30)


def test_an_assistants_refusal_part_reads_as_its_text():
    """OpenAI's assistant messages may carry {type: refusal} parts (a replayed conversation does): read as
    text, as vLLM reads them; other kinds are still refused, naming them."""
    from gateway.server import HTTPError, _text_content

    assert _text_content([{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "no"}]) == "a\nno"
    for bad, said in (([{"type": "refusal", "text": "no"}], "refusal"), ([{"type": "image_url"}], "image_url")):
        with pytest.raises(HTTPError, match=said):
            _text_content(bad)
