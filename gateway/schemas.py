"""The OpenAI request bodies the gateway accepts (unknown fields are ignored, as OpenAI's SDKs send
some), validated by msgspec: a wrong type or range is a 400 naming the field. Fields that would change
the answer and are not supported are declared, so that the gateway refuses them instead of ignoring
them."""

from __future__ import annotations

from typing import Any, Union

import msgspec

# a string, a list of strings, token ids, or a list of token-id lists (checked by the gateway:
# msgspec unions cannot hold several list types)
Prompt = Union[str, list[Any]]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False  # (null: false, as OpenAI reads it)
    continuous_usage_stats: bool | None = False  # (vLLM's usage on every chunk: not served, refused)


class SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    best_of: int | None = None  # accepted only equal to n
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}, added to its logit
    # vLLM's extra parameters
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: up to the context length)
    prompt_logprobs: int | None = None  # each prompt token's logprob and rank, with this many alternatives
    # structured outputs (moemesh/structured.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields; at most one per request
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: str | None = None  # (vLLM's: the whitespace a JSON constraint allows)
    allowed_token_ids: list[int] | None = None  # only these tokens are sampled
    bad_words: list[str] | None = None  # words never generated (at the text's start or after a space)
    cache_salt: str | None = None  # the prefix cache shares this prompt's blocks only with the same salt's
    # beam search (gateway/beam.py): n beams returned of best_of (default n) searched
    use_beam_search: bool = False
    length_penalty: float = 1.0  # a finished beam's score: summed logprob / generated tokens ** length_penalty
    early_stopping: bool | str = False  # true: stop once best_of beams finished; "never": only when none can win
    # vLLM's, not supported: refused where given (VLLM_UNSUPPORTED), since each would change the answer
    return_tokens_as_token_ids: bool = False
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None


CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
VLLM_UNSUPPORTED = ("return_tokens_as_token_ids",
                    "spaces_between_special_tokens", "logits_processors")


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt
    # left out: 16 (OpenAI's default); null: the rest of the context (as vLLM)
    max_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token (0..20)
    suffix: str | None = None  # (not supported: refused unless empty)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the answer continues the last message (as transformers and vLLM do)
    add_special_tokens: bool = False  # a BOS before the rendered template (which usually writes its own)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None  # function tools (gateway/tools.py)
    tool_choice: Any = None  # none, auto, required or a function; default: auto with tools, else none
    parallel_tool_calls: bool | None = None  # false: tool_choice required makes one call at most
    include_reasoning: bool = True  # false: a --reasoning-parser's thought is left out of the answer (vLLM's)
    reasoning_effort: str | None = None  # OpenAI's: the chat template's reasoning_effort (as vLLM passes it)
    # (not supported: refused where they would change the answer)
    functions: Any = None  # the legacy form of tools
    function_call: Any = None  # the legacy form of tool_choice
    echo: bool = False
    chat_template: str | None = None  # a template from the request (vLLM also refuses one unless trusted)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as the endpoints)
    # for messages, as /v1/chat/completions takes them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None  # rendered by the chat template, as /v1/chat/completions renders them
    chat_template: str | None = None  # (refused, as /v1/chat/completions refuses it: not silently ignored)
    model: str | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
