"""gateway.chat.ChatTemplate renders exactly what transformers' apply_chat_template renders: the tiny
model's ChatML template, and realistic templates (Llama-3, Mixtral-Instruct, Qwen-style namespace,
tojson, whitespace control) written into copies of the model dir."""

from __future__ import annotations

import json
import shutil

import jinja2
import pytest
from transformers import AutoTokenizer

from gateway.chat import ChatTemplate, TemplateError
from moemesh.entrypoints.tiny_model import BOS, ENDOFTEXT, TinyModelSpec, write_tiny_model

SPEC = TinyModelSpec(arch="mixtral", num_layers=1, hidden_size=32, intermediate_size=32, num_heads=2,
                     num_kv_heads=1, num_experts=2, top_k=1, vocab_size=600)

SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
MULTI_TURN = [
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "Write a poem about the sea."},
    {"role": "assistant", "content": "The sea is grey, the sea is blue."},
    {"role": "user", "content": "Thanks."},
]
SYSTEM_MULTI_TURN = [{"role": "system", "content": "Be brief."}] + MULTI_TURN
UNICODE = [
    {"role": "system", "content": "Réponds en français. 日本語も可。"},
    {"role": "user", "content": "  Ça va? 👍🏽 \"quoted\" <b>tag</b> & {{ not jinja }}\n\n  "},
]
CONVERSATIONS = {"system_user": SYSTEM_USER, "multi_turn": MULTI_TURN, "system_multi_turn": SYSTEM_MULTI_TURN,
                 "unicode": UNICODE}

# Meta-Llama-3-8B-Instruct's template as shipped, reformatted over lines so that it relies on
# trim_blocks / lstrip_blocks, plus a role check.
LLAMA3 = """\
{% set loop_messages = messages %}
{% for message in loop_messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}
    {% if loop.first %}
        {% set content = bos_token + content %}
    {% endif %}
{{ content }}
{%- endfor %}
{% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Mixtral-8x7B-Instruct-v0.1's template (current hub revision).
MIXTRAL = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Qwen-style: namespace(), reverse loop with break, tojson of dicts (non-ASCII kept), extra kwargs.
QWEN_LIKE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = messages|length - 1 - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- if extra is defined %}
    {{- '<|im_start|>system\\n# Extra\\n' + (extra | tojson) + '\\n' + (extra | tojson(indent=2, sort_keys=true)) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if loop.index0 == ns.last_user %}{{- '[last user] ' }}{% endif %}
    {{- message.content + '<|im_end|>\\n' }}
    {{- {'i': loop.index, 'role': message.role, 'n': message.content|length} | tojson + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(SPEC, tmp_path_factory.mktemp("chat") / "tiny")


def _copy_with(model_dir, tmp_path, template=None, jinja_file=None, config_updates=None):
    """A copy of the tokenizer files with another template in tokenizer_config.json (None: removed) and
    optionally a chat_template.jinja."""
    d = tmp_path / "model"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(model_dir / name, d / name)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    config.update(config_updates or {})
    (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if jinja_file is not None:
        (d / "chat_template.jinja").write_text(jinja_file, encoding="utf-8")
    return d


def _both(d, messages, add_generation_prompt, **kwargs) -> tuple[str, str]:
    ours = ChatTemplate.from_dir(d).render(messages, add_generation_prompt, **kwargs)
    theirs = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_tiny_model_template_matches_transformers(model_dir, conv, add_generation_prompt):
    ours, theirs = _both(model_dir, CONVERSATIONS[conv], add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<|im_start|>") and ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    for m in CONVERSATIONS[conv]:
        assert f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" in ours


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_llama3_template_matches_transformers(model_dir, tmp_path, conv, add_generation_prompt):
    d = _copy_with(model_dir, tmp_path, LLAMA3)
    ours, theirs = _both(d, CONVERSATIONS[conv], add_generation_prompt)
    assert ours == theirs
    assert ours.startswith(BOS + "<|start_header_id|>") and ours.count(BOS) == 1  # bos_token, loop.first
    assert ours.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") == add_generation_prompt


def test_llama3_template_depends_on_trim_and_lstrip_blocks(model_dir):
    """Precondition: without trim_blocks / lstrip_blocks the template renders differently, so the
    comparison above would catch an environment that lacks them."""
    plain = jinja2.Environment().from_string(LLAMA3).render(
        messages=SYSTEM_USER, add_generation_prompt=True, bos_token=BOS, raise_exception=None)
    ours = ChatTemplate(LLAMA3, {"bos_token": BOS}).render(SYSTEM_USER, True)
    assert plain != ours
    assert ours == (f"{BOS}<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("conv", ["system_user", "multi_turn", "system_multi_turn", "unicode"])
def test_mixtral_instruct_template_matches_transformers(model_dir, tmp_path, conv):
    d = _copy_with(model_dir, tmp_path, MIXTRAL)
    ours, theirs = _both(d, CONVERSATIONS[conv], False)
    assert ours == theirs
    assert ours.startswith(BOS + " [INST] ")
    assert ours.count(ENDOFTEXT) == sum(m["role"] == "assistant" for m in CONVERSATIONS[conv])  # eos_token


@pytest.mark.parametrize("template,messages,message", [
    (LLAMA3, SYSTEM_USER + [{"role": "tool", "content": "42"}], "Unknown role: tool"),
    (MIXTRAL, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "After the optional system message, conversation roles must alternate user/assistant/user/assistant..."),
])
def test_raise_exception_surfaces_as_template_error_with_the_message(model_dir, tmp_path, template, messages,
                                                                    message):
    d = _copy_with(model_dir, tmp_path, template)
    with pytest.raises(TemplateError) as ours:
        ChatTemplate.from_dir(d).render(messages, True)
    assert str(ours.value) == message
    with pytest.raises(jinja2.TemplateError, match="^" + message.replace(".", r"\.") + "$"):  # transformers agrees
        AutoTokenizer.from_pretrained(str(d)).apply_chat_template(messages, tokenize=False)


def test_undefined_variable_error_is_a_template_error(model_dir):
    with pytest.raises(TemplateError, match="no_such_thing"):
        ChatTemplate("{{ no_such_thing.attr }}", {}).render(SYSTEM_USER)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", ["system_multi_turn", "unicode"])
def test_namespace_break_and_tojson_template_matches_transformers(model_dir, tmp_path, conv, add_generation_prompt):
    d = _copy_with(model_dir, tmp_path, QWEN_LIKE)
    extra = {"städte": ["Paris", "東京"], "n": 3, "nested": {"ok": True, "none": None}}
    ours, theirs = _both(d, CONVERSATIONS[conv], add_generation_prompt, extra=extra)
    assert ours == theirs
    assert json.dumps(extra, ensure_ascii=False) in ours and "東京" in ours  # tojson keeps non-ASCII
    assert "[last user] " + CONVERSATIONS[conv][-1]["content"] in ours  # namespace + break found the last user turn
    assert "# Extra" not in ChatTemplate.from_dir(d).render(CONVERSATIONS[conv], add_generation_prompt)


def test_chat_template_jinja_file_takes_precedence_over_tokenizer_config(model_dir, tmp_path):
    d = _copy_with(model_dir, tmp_path, "CONFIG {{ messages | length }}", jinja_file=LLAMA3)
    ours, theirs = _both(d, MULTI_TURN, True)
    assert ours == theirs
    assert not ours.startswith("CONFIG") and ours.startswith(BOS + "<|start_header_id|>user")


def test_named_templates_in_tokenizer_config_use_the_default_one(model_dir, tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS {{ messages | length }}"}, {"name": "default", "template": LLAMA3}]
    d = _copy_with(model_dir, tmp_path, named)
    ours, theirs = _both(d, SYSTEM_USER, True)
    assert ours == theirs and ours.startswith(BOS + "<|start_header_id|>system")


def test_special_tokens_given_as_added_token_dicts(model_dir, tmp_path):
    def added(content):
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False, "special": True}
    d = _copy_with(model_dir, tmp_path, "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ messages[0].content }}",
                   config_updates={"bos_token": added(BOS), "eos_token": added(ENDOFTEXT)})
    ours, theirs = _both(d, SYSTEM_USER, True)
    assert ours == theirs == f"{BOS}|{ENDOFTEXT}|{ENDOFTEXT}|You are a helpful assistant."


def test_model_dir_without_a_template_gives_none(model_dir, tmp_path):
    d = _copy_with(model_dir, tmp_path, None)
    assert ChatTemplate.from_dir(d) is None
    (d / "tokenizer_config.json").unlink()
    assert ChatTemplate.from_dir(d) is None
    assert ChatTemplate.from_dir(model_dir) is not None  # the original has one


# --- where moemesh renders differently from transformers ---------------------------------------------------

# Mistral-7B-Instruct-v0.3 (and Mixtral-8x22B-Instruct) guard their tool block with `tools is not none`.
MISTRAL_TOOLS = """\
{%- set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}
            {{- '][/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST] ' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# Llama-3.2-Instruct takes today's date from strftime_now when the template environment offers it.
LLAMA32_DATE = """\
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{{- bos_token + 'Today Date: ' + date_string }}
"""


def test_template_sees_tools_and_documents_as_none_when_not_given(model_dir, tmp_path):
    d = _copy_with(model_dir, tmp_path, MISTRAL_TOOLS)
    ours, theirs = _both(d, MULTI_TURN, False)
    assert "[AVAILABLE_TOOLS]" not in theirs
    assert ours == theirs


def test_strftime_now_is_available_like_in_transformers(model_dir, tmp_path):
    d = _copy_with(model_dir, tmp_path, LLAMA32_DATE)
    ours, theirs = _both(d, SYSTEM_USER, True)
    assert "26 Jul 2024" not in theirs
    assert ours == theirs


def test_tojson_accepts_separators(model_dir, tmp_path):
    d = _copy_with(model_dir, tmp_path, "{{ {'a': [1, 2], 'b': 'é'} | tojson(separators=(',', ':')) }}")
    ours, theirs = _both(d, SYSTEM_USER, False)
    assert theirs == '{"a":[1,2],"b":"é"}'
    assert ours == theirs


def test_generation_block_renders_its_body(model_dir, tmp_path):
    template = ("{%- for m in messages %}{{- m.role + ': ' }}{%- if m.role == 'assistant' %}{% generation %}"
                "{{- m.content }}{% endgeneration %}{%- else %}{{- m.content }}{%- endif %}\n{%- endfor %}")
    d = _copy_with(model_dir, tmp_path, template)
    ours, theirs = _both(d, MULTI_TURN, False)
    assert "assistant: Hi, how can I help?" in theirs
    assert ours == theirs


def test_a_requests_template_kwargs_override_the_special_tokens():
    """chat_template_kwargs: {"bos_token": ...} replaces the tokenizer's, as transformers' apply_chat_template
    lets it (it had been a 400: bos_token given twice)."""
    template = ChatTemplate("{{ bos_token }}{{ messages[0]['content'] }}", {"bos_token": "<s>"})
    assert template.render(SYSTEM_USER[:1], False) == "<s>" + SYSTEM_USER[0]["content"]
    assert template.render(SYSTEM_USER[:1], False, bos_token="") == SYSTEM_USER[0]["content"]
