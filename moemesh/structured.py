"""Structured outputs: the request fields that constrain a completion to a JSON schema, a regular
expression, a list of choices or a grammar, turned into one llguidance grammar (a JSON text) that
travels with the sequence's sampling parameters (`SamplingParams.grammar`). The last stage masks
each step's logits with it (stage_worker/grammar.py), so every token sampled keeps the text a
prefix of something the constraint accepts, and the sequence can end (EOS) only where it is whole.

The fields are vLLM's and OpenAI's: `response_format` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"schema": ...}}), vLLM's `structured_outputs` ({"json": ...},
{"regex": ...}, {"choice": [...]}, {"grammar": ...}, {"json_object": true}) and its older
`guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. A grammar is Lark (llguidance's
syntax) or GBNF (llama.cpp's). JSON takes any whitespace between tokens by default, as vLLM's does;
`disable_any_whitespace` (or "x-guidance": {"whitespace_flexible": false} in the schema) allows
none.

No torch here: the gateway validates a constraint (a 400 naming the field) before it is queued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance

from moemesh.sampling import MAX_GRAMMAR_CHARS

# vLLM's structured_outputs keys: the constraint (exactly one), then the options this server honours
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# (backend and disable_fallback choose among vLLM's grammar libraries: this server has one)
_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback", "backend")


class ConstraintError(ValueError):
    """A constraint that cannot be used: `param` names the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tokenizer(model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's reading of the checkpoint's tokenizer.json (the one the last stage reads too, with
    the logits' width and the model's EOS ids); raises ValueError where it has none it can read."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {model_dir}")
    try:
        return llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
    except Exception as e:  # (llguidance raises ValueError or RuntimeError for a tokenizer it cannot read)
        raise ValueError(f"llguidance cannot read {path}: {_first_line(str(e))}") from None


def grammar_of(fields: dict[str, Any], tokenizer=None, whitespace_pattern: str | None = None) -> str | None:
    """The llguidance grammar of a request's constraint fields (their names as the request spells them;
    None or absent: not given), or None where none is given. Raises ConstraintError for more than
    one, a malformed one, or one llguidance refuses (with `tokenizer`, the model's LLTokenizer, also
    one naming tokens the model does not have). whitespace_pattern: vLLM's guided_whitespace_pattern,
    for a JSON constraint (structured_outputs' own whitespace_pattern takes precedence)."""
    given = {k: v for k, v in fields.items() if v is not None and not (k == "response_format" and _is_text(v))}
    if not given:
        if whitespace_pattern is not None:
            raise ConstraintError("guided_whitespace_pattern applies to a JSON constraint, and none is given",
                                  "guided_whitespace_pattern")
        return None
    if len(given) > 1:
        names = sorted(given)
        raise ConstraintError(f"give one of {', '.join(names)}: each constrains the output on its own", names[-1])
    (field, value), = given.items()
    if field == "response_format":
        kind, spec, options = _response_format(value)
    elif field == "structured_outputs":
        kind, spec, options = _structured_outputs(value)
    else:
        kind, spec, options = field.removeprefix("guided_"), value, {}
    if whitespace_pattern is not None:
        if kind not in ("json", "json_object"):
            raise ConstraintError(f"guided_whitespace_pattern applies to a JSON constraint, not to {field}'s",
                                  "guided_whitespace_pattern")
        options = {"whitespace_pattern": whitespace_pattern, **options}
    grammar = _compile(kind, spec, options, field)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"{field} is too large ({len(grammar)} characters compiled; at most "
                              f"{MAX_GRAMMAR_CHARS})", field)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if failed:  # (a warning, such as a schema keyword only checked loosely, lets it through)
        raise ConstraintError(f"{field}: {_first_line(messages[0] if messages else 'invalid')}", field)
    return grammar


def after_thought(grammar: str, inside: bool, tags: tuple[int, int] | None = None,
                  eos_token_ids: tuple[int, ...] = (), tokenizer=None, field: str = "grammar") -> str:
    """`grammar` applied after a reasoning model's thought, as vLLM applies structured outputs with a
    reasoning parser: the answer may first think (`<think>` ... `</think>`; from its first token where
    `inside`, the prompt having opened the thought) with no constraint, then follows `grammar`
    (after the newlines that close the thought). tags: the ids of `<think>` and `</think>` where they
    are special tokens, matched as tokens (a thought then holds no EOS); else they are matched as text.
    With `tokenizer`, the wrapped grammar is checked as grammar_of checks one (ConstraintError naming
    `field`)."""
    try:
        top = json.loads(grammar)
    except ValueError:  # (Lark text, as llguidance gives a choice's or a grammar's)
        top = None
    if not isinstance(top, dict):
        top = {"grammars": [{"lark_grammar": grammar}]}
    grammars = top["grammars"]
    taken = {g.get("name") for g in grammars}
    inner = grammars[0].get("name") or next(n for n in (f"answer{k}" for k in range(len(taken) + 1))
                                             if n not in taken)
    if tags is not None:
        opener, closer = tags
        banned = ",".join(str(t) for t in sorted({closer, *eos_token_ids}))
        thought, opening, rules = f"<[^{banned}]>* <[{closer}]>", f"<[{opener}]>", ""
    else:
        thought, opening, rules = "thought", '"<think>"', '\nthought[stop="</think>"]: /(?s:.*)/'
    start = f'{thought} "\\n"*' if inside else f'({opening} {thought} "\\n"*)?'
    lark = f"start: {start} @{inner}{rules}\n"
    wrapped = json.dumps({**top, "grammars": [{"lark_grammar": lark}, {**grammars[0], "name": inner}, *grammars[1:]]})
    if len(wrapped) > MAX_GRAMMAR_CHARS:
        raise ConstraintError(f"{field} is too large ({len(wrapped)} characters compiled, with the thought before "
                              f"it; at most {MAX_GRAMMAR_CHARS})", field)
    if tokenizer is not None:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(wrapped, tokenizer)
        if failed:
            raise ConstraintError(f"{field}: {_first_line(messages[0] if messages else 'invalid')}", field)
    return wrapped


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type", "text") == "text"


def _response_format(value: Any) -> tuple[str, Any, dict]:
    if not isinstance(value, dict):
        raise ConstraintError("response_format must be an object with a type", "response_format")
    kind = value.get("type")
    if kind == "json_object":
        return "json_object", None, {}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError('response_format of type json_schema needs "json_schema": {"name": ..., '
                                  '"schema": {...}}', "response_format")
        return "json", spec["schema"], {}
    raise ConstraintError(f"response_format type must be text, json_object or json_schema, not {kind!r}",
                          "response_format")


def _structured_outputs(value: Any) -> tuple[str, Any, dict]:
    if not isinstance(value, dict):
        raise ConstraintError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(value) - set(_KINDS) - set(_OPTIONS))
    if unknown:
        raise ConstraintError(f"structured_outputs: {unknown[0]} is not supported by this server (it takes "
                              f"{', '.join(_KINDS)})", "structured_outputs")
    kinds = [k for k in _KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ConstraintError(f"structured_outputs takes exactly one of {', '.join(_KINDS)}", "structured_outputs")
    options = {k: value[k] for k in _OPTIONS if value.get(k) is not None}
    return kinds[0], value[kinds[0]], options


def _compile(kind: str, spec: Any, options: dict, field: str) -> str:
    """llguidance's grammar text of one constraint."""
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else spec
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ConstraintError(f"{field}: a JSON schema is an object", field)
            overrides = {}
            if options.get("disable_any_whitespace"):
                overrides["whitespace_flexible"] = False
            if options.get("whitespace_pattern") is not None:
                if not isinstance(options["whitespace_pattern"], str):
                    raise ConstraintError(f"{field}: whitespace_pattern is a regular expression (a string)", field)
                overrides["whitespace_pattern"] = options["whitespace_pattern"]
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides or None)
        if kind == "regex":
            if not isinstance(spec, str):
                raise ConstraintError(f"{field}: a regular expression is a string", field)
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise ConstraintError(f"{field}: choices are a list of non-empty strings", field)
            return llguidance.grammar_from("choice", spec)
        if kind == "grammar":
            if not isinstance(spec, str) or not spec.strip():
                raise ConstraintError(f"{field}: a grammar is a string (Lark or GBNF)", field)
            return llguidance.grammar_from("grammar", spec)
    except ConstraintError:
        raise
    except (ValueError, TypeError, RecursionError) as e:  # (json's JSONDecodeError is a ValueError)
        raise ConstraintError(f"{field}: {_first_line(str(e))}", field) from None
    raise ConstraintError(f"{field}: unknown constraint {kind!r}", field)


def _first_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3])[:500] if lines else "invalid constraint"
