"""Chat templates rendered the way transformers renders them: a sandboxed jinja2 environment with
trim_blocks / lstrip_blocks, loop controls, the `{% generation %}` block, `tojson`,
`raise_exception`, `strftime_now`, `tools` / `documents` defaulting to None, and the tokenizer's
special tokens."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    pass


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part for training masks; when
    rendering a prompt it is just its content."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

    def _content(self, caller):
        return caller()


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.template = env.from_string(source)
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ChatTemplate | None":
        d = Path(model_dir)
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        source = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").is_file() \
            else config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(source, tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        # (a request's chat_template_kwargs override the special tokens, as transformers lets them)
        kwargs = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateError:
            raise
        except Exception as e:  # a template bug (or a message it cannot handle): the client's request fails
            raise TemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
