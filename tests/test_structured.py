"""Structured outputs (moemesh/structured.py, stage_worker/grammar.py): the request fields become one
llguidance grammar, the last stage masks each step's logits with it, and greedy decoding under a
constraint matches transformers' logits masked by a matcher of the same grammar, step by step, in
each pipeline layout, after preemption and with several decode steps per schedule."""

from __future__ import annotations

import json
import re

import llguidance
import pytest
import torch

from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
from moemesh.sampling import SamplingParams
from moemesh.structured import ConstraintError, grammar_of
from stage_worker.sampler import SampleRow, sample

SPEC = TinyModelSpec(arch="mixtral", num_layers=2, hidden_size=64, intermediate_size=64, num_experts=4,
                     vocab_size=600, max_position_embeddings=256)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
CASES = {  # (request fields, a check of the text a complete answer must pass)
    "choice": ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    "regex": ({"guided_regex": r"[0-9]{2}-[a-z]{3}"}, lambda t: re.fullmatch(r"[0-9]{2}-[a-z]{3}", t)),
    "json": ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
             lambda t: set(json.loads(t)) == {"ok", "n"} and 0 <= json.loads(t)["n"] <= 99),
    "lark": ({"guided_grammar": 'start: "a" ("," "a")* "."'}, lambda t: re.fullmatch(r"a(,a)*\.", t)),
    "gbnf": ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x[0-9]{1,2}", t)),
    "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
}
PROMPTS = [[261, 293, 82, 549], [5, 17, 33, 2, 9, 100, 41, 7, 250, 3], [400, 401, 402]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(SPEC, tmp_path_factory.mktemp("structured") / "tiny-mixtral")


@pytest.fixture(scope="module")
def oracle(model):
    """Greedy tokens of transformers' model under a grammar: each step's logits masked by a matcher of
    the same grammar (its own tokenizer, built here), the first maximum taken, stopping at EOS."""
    from transformers import AutoModelForCausalLM

    from moemesh.config import ModelConfig

    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", dtype=torch.float32).eval()
    eos = ModelConfig.from_dir(model).eos_token_ids
    tokenizer = llguidance.LLTokenizer((model / "tokenizer.json").read_text(), n_vocab=SPEC.vocab_size,
                                       eos_token=list(eos))

    def greedy(prompt: list[int], grammar: str, max_tokens: int) -> list[int]:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        tokens: list[int] = []
        with torch.no_grad():
            while len(tokens) < max_tokens:
                logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].float()
                bits = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)
                allowed = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)[:SPEC.vocab_size]
                tokens.append(int(logits.masked_fill(allowed == 0, float("-inf")).argmax()))
                if tokens[-1] in eos:
                    break
                assert matcher.consume_token(tokens[-1])
        return tokens

    return greedy


def _engine(model, **cfg):
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings

    return LLMEngine(EngineSettings(model=str(model), **{"num_kv_blocks": 64, **cfg}), progress=False)


def _text(model, ids: list[int]) -> str:
    from moemesh.tokenizer import TextTokenizer

    return TextTokenizer(model).decode(ids, skip_special_tokens=True)


def test_request_fields_become_one_grammar_or_a_clear_error():
    assert grammar_of({"response_format": {"type": "text"}, "guided_json": None}) is None
    assert grammar_of({"guided_choice": ["a", 'b "quoted" \\ é']}) is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    same = [grammar_of({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
            grammar_of({"guided_json": schema}), grammar_of({"guided_json": json.dumps(schema)}),
            grammar_of({"structured_outputs": {"json": schema}})]
    assert len(set(same)) == 1
    bad = {  # field -> (request, words the message must hold)
        "guided_regex": ({"guided_regex": "[0-9"}, "regex"),
        "guided_json": ({"guided_json": "{not json"}, "guided_json"),
        "guided_choice": ({"guided_choice": []}, "non-empty"),
        "guided_grammar": ({"guided_grammar": 'root ::= "a'}, "grammar"),
        "response_format": ({"response_format": {"type": "xml"}}, "json_schema"),
        "structured_outputs": ({"structured_outputs": {"structural_tag": "{}"}}, "not supported"),
    }
    for param, (fields, words) in bad.items():
        with pytest.raises(ConstraintError) as e:
            grammar_of(fields)
        assert e.value.param == param and words in str(e.value), (param, str(e.value))
    with pytest.raises(ConstraintError, match="give one of") as e:
        grammar_of({"guided_regex": "a", "response_format": {"type": "json_object"}})
    with pytest.raises(ConstraintError, match="Invalid type"):
        grammar_of({"guided_json": {"type": "objectx"}})
    with pytest.raises(ValueError, match="grammar must be"):
        SamplingParams(grammar="")
    # vLLM's guided_whitespace_pattern is structured_outputs' whitespace_pattern, for a JSON constraint only
    tight = grammar_of({"guided_json": schema}, whitespace_pattern="")
    assert tight == grammar_of({"structured_outputs": {"json": schema, "whitespace_pattern": ""}}) != same[0]
    for fields in ({"guided_regex": "a"}, {}):
        with pytest.raises(ConstraintError) as e:
            grammar_of(fields, whitespace_pattern="")
        assert e.value.param == "guided_whitespace_pattern"


@pytest.mark.parametrize("pp", [1, 2])
def test_greedy_under_each_constraint_matches_transformers_masked_alike(model, oracle, pp):
    """Every constraint and an unconstrained request in one batch; each answer token for token the
    oracle's, and the text of each complete one what its constraint accepts."""
    engine = _engine(model, pp=pp)
    jobs = [(name, prompt) for name in CASES for prompt in PROMPTS[:2]]
    params = [SamplingParams(max_tokens=40, temperature=0, grammar=grammar_of(CASES[name][0])) for name, _ in jobs]
    outs = engine.generate([p for _, p in jobs] + [PROMPTS[2]], params + [SamplingParams(max_tokens=8, temperature=0)])
    for (name, prompt), sp, out in zip(jobs, params, outs):
        assert out.token_ids == oracle(prompt, sp.grammar, 40), name
        if out.finish_reason == "stop":
            assert CASES[name][1](_text(model, out.token_ids)), (name, _text(model, out.token_ids))
    assert sum(o.finish_reason == "stop" for o in outs[:-1]) >= len(jobs) - 2  # (most end within 40 tokens)
    assert len(outs[-1].token_ids) == 8 or outs[-1].finish_reason == "stop"


def test_constraints_hold_through_preemption_and_multi_step_schedules(model, oracle):
    """A KV pool too small for the batch (sequences are preempted and recomputed, their matchers
    rebuilt from their tokens) and four decode steps per schedule give the same tokens."""
    name_prompt = [(name, prompt) for name in ("json", "regex", "lark") for prompt in PROMPTS]
    params = [SamplingParams(max_tokens=24, temperature=0, grammar=grammar_of(CASES[name][0]))
              for name, _ in name_prompt]
    want = [oracle(prompt, sp.grammar, 24) for (_, prompt), sp in zip(name_prompt, params)]
    for cfg in ({"num_kv_blocks": 12, "block_size": 4}, {"num_scheduler_steps": 4}):
        engine = _engine(model, **cfg)
        outs = engine.generate([p for _, p in name_prompt], params)
        assert [o.token_ids for o in outs] == want, cfg
        assert (engine.scheduler.num_preemptions > 0) == ("num_kv_blocks" in cfg)  # (the pool is small on purpose)


def test_constrained_rows_beside_decodes_with_drafts_keep_their_tokens(model, oracle):
    """Speculative decoding drafts for plain greedy rows only: constrained rows in the same steps decode
    one token a step, masked as before, and the greedy rows keep their own tokens."""
    name_prompt = [(name, prompt) for name in ("json", "regex") for prompt in PROMPTS[:2]]
    params = [SamplingParams(max_tokens=24, temperature=0, grammar=grammar_of(CASES[name][0]))
              for name, _ in name_prompt]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free = [o.token_ids for o in _engine(model).generate(PROMPTS, [plain] * len(PROMPTS))]
    engine = _engine(model, num_speculative_tokens=3, ngram_prompt_lookup_min=1, speculative_disable_by_batch_size=64)
    outs = engine.generate([p for _, p in name_prompt] + PROMPTS, params + [plain] * len(PROMPTS))
    assert [o.token_ids for o in outs] == [oracle(p, sp.grammar, 24) for (_, p), sp in zip(name_prompt, params)] + free
    assert engine.scheduler.num_drafted > 0


def test_sampled_answers_follow_their_constraint(model):
    engine = _engine(model)
    for name, (fields, check) in CASES.items():
        grammar = grammar_of(fields)
        outs = engine.generate([PROMPTS[0]] * 4, [SamplingParams(max_tokens=48, temperature=1.0, seed=7 + i,
                                                                 grammar=grammar) for i in range(4)])
        assert any(o.finish_reason == "stop" for o in outs), name
        for out in outs:
            if out.finish_reason == "stop":
                assert check(_text(model, out.token_ids)), (name, _text(model, out.token_ids))


def test_a_complete_answer_ends_even_under_min_tokens_or_ignore_eos(model):
    """Where the grammar allows only the end of sequence, that ends it: min_tokens and ignore_eos
    would otherwise have it sample EOS until they were met."""
    engine = _engine(model)
    grammar = grammar_of({"guided_choice": ["yes", "no"]})
    free = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, grammar=grammar))[0]
    for extra in ({"min_tokens": 20}, {"ignore_eos": True}):
        out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, grammar=grammar, **extra))[0]
        assert out.token_ids == free.token_ids and out.finish_reason == "stop", extra
    assert _text(model, free.token_ids) in ("yes", "no")


def test_the_gateway_refuses_a_grammar_naming_tokens_the_model_lacks(model):
    from moemesh.config import ModelConfig
    from moemesh.structured import tokenizer

    config = ModelConfig.from_dir(model)
    tok = tokenizer(model, config.vocab_size, config.eos_token_ids)
    assert grammar_of({"guided_grammar": 'start: "a" <|im_end|>'}, tok)
    for grammar in ('start: "a" <|nosuch|>', 'start: "a" <[99999]>'):
        assert grammar_of({"guided_grammar": grammar})  # (without the tokenizer it cannot tell)
        with pytest.raises(ConstraintError) as e:
            grammar_of({"guided_grammar": grammar}, tok)
        assert e.value.param == "guided_grammar"
    with pytest.raises(ValueError, match="tokenizer.json"):
        tokenizer(model / "nowhere", config.vocab_size, config.eos_token_ids)


def test_a_finished_grammar_ends_the_sequence_even_before_min_tokens():
    """Where the grammar allows only the end of sequence, min_tokens' ban of EOS gives way (it would
    leave nothing to sample)."""
    logits = torch.randn(2, 10)
    end_only = torch.zeros(10, dtype=torch.bool)
    end_only[0] = True
    some = torch.zeros(10, dtype=torch.bool)
    some[[0, 4, 7]] = True
    params = SamplingParams(temperature=0, min_tokens=5, grammar="start: \"a\"")
    tokens, _ = sample(logits, [SampleRow(params, [], [], end_only), SampleRow(params, [], [], some)], (0,))
    assert tokens[0] == 0
    assert tokens[1] == [4, 7][int(logits[1, 7] > logits[1, 4])]


def test_a_matcher_follows_the_tokens_it_is_given_back_and_forth(model):
    """The executor's tokens may shrink and change (a step re-run after a recovery): the matcher rolls
    back to where they agree, so its mask is a fresh matcher's for the same tokens."""
    from moemesh.config import ModelConfig
    from stage_worker.grammar import Grammars

    eos = ModelConfig.from_dir(model).eos_token_ids
    grammars = Grammars(model, SPEC.vocab_size, eos)
    grammar = grammar_of({"guided_json": SCHEMA})
    tokenizer = grammars.tokenizer()
    a = tokenizer.tokenize_str('{"ok":true,"n":1')
    b = tokenizer.tokenize_str('{"ok":false')
    state, _ = grammars.allowed(None, grammar, a, seq_id=1)
    for tokens in (b, a[:3], a, []):
        state, mask = grammars.allowed(state, grammar, tokens, seq_id=1)
        assert torch.equal(mask, grammars.allowed(None, grammar, tokens, seq_id=2)[1]), tokens
        assert state.consumed == tokens
    closed = tokenizer.tokenize_str('{"ok":true,"n":1}')
    _, mask = grammars.allowed(None, grammar, closed, seq_id=3)
    assert mask.nonzero().view(-1).tolist() == sorted(eos)  # complete: only the end of sequence


def test_a_worker_without_the_tokenizer_ends_the_sequence_and_says_why(model, tmp_path, caplog):
    from stage_worker.grammar import Grammars

    grammars = Grammars(tmp_path, SPEC.vocab_size, (0, 3))
    grammar = grammar_of({"guided_choice": ["yes"]})
    with caplog.at_level("WARNING", logger="moemesh.stage_worker"):
        state, mask = grammars.allowed(None, grammar, [], seq_id=9)
        state, mask = grammars.allowed(state, grammar, [5], seq_id=9)
    assert mask.nonzero().view(-1).tolist() == [0]
    warnings = [r for r in caplog.records if "structured output" in r.getMessage()]
    assert len(warnings) == 1 and "tokenizer.json" in warnings[0].fields["reason"]


def test_the_gateway_sends_a_grammar_only_to_a_coordinator_that_knows_of_it(model):
    """An older coordinator would drop SamplingParams.grammar unread and answer unconstrained: the
    gateway refuses (503) instead; a model llguidance cannot read is a 400 naming the field."""
    import msgspec

    from gateway.schemas import CompletionRequest
    from gateway.server import Gateway, HTTPError
    from moemesh.config import ModelConfig
    from moemesh.protocol import PROTOCOL_VERSION, StatusReply
    from moemesh.structured import tokenizer

    config = ModelConfig.from_dir(model)
    gateway = object.__new__(Gateway)
    gateway.grammar_tokenizer, gateway.grammar_unavailable = tokenizer(model, config.vocab_size, config.eos_token_ids), None
    gateway.status = StatusReply(serving=True, num_blocks=1, num_free_blocks=1, num_running=0, num_waiting=0,
                                 num_preemptions=0, stage_busy_seconds=[], stage_comm_seconds=[], uptime_seconds=1,
                                 malformed_messages=0, protocol=5)  # (grammars came with protocol 6)
    body = msgspec.convert({"prompt": "x", "guided_choice": ["a", "b"]}, CompletionRequest)
    with pytest.raises(HTTPError) as e:
        gateway._grammar(body, None)
    assert e.value.status == 503 and "protocol 5" in e.value.message
    assert gateway._grammar(msgspec.convert({"prompt": "x"}, CompletionRequest), None) is None  # (nothing to drop)
    gateway.status = msgspec.structs.replace(gateway.status, protocol=6)
    assert gateway._grammar(body, None)
    # logit_bias and allowed_token_ids came with protocol 7
    from moemesh.tokenizer import TextTokenizer

    gateway.defaults, gateway.max_model_len, gateway.vocab_size = {}, 256, config.vocab_size
    gateway.tokenizer = TextTokenizer(model)
    for fields in ({"logit_bias": {"5": 1}}, {"allowed_token_ids": [5, 5, 9]}, {"bad_words": ["the"]}):
        edited = msgspec.convert({"prompt": "x", **fields}, CompletionRequest)
        with pytest.raises(HTTPError) as e:
            gateway._params(edited, 1, 4, None, None)
        assert e.value.status == 503 and next(iter(fields)) in e.value.message
        gateway.status = msgspec.structs.replace(gateway.status, protocol=PROTOCOL_VERSION)
        params = gateway._params(edited, 1, 4, None, None)
        assert params.logit_bias == ((5, 1.0),) or params.allowed_token_ids == (5, 9) or params.bad_words  # (ids once)
        gateway.status = msgspec.structs.replace(gateway.status, protocol=6)
    gateway.status = msgspec.structs.replace(gateway.status, protocol=PROTOCOL_VERSION)
    twice = msgspec.convert({"prompt": "x", "logit_bias": {"5": 1, "05": -2}}, CompletionRequest)
    assert gateway._params(twice, 1, 4, None, None).logit_bias == ((5, -2.0),)  # (one token: the last bias)
    # guided_whitespace_pattern shapes the JSON constraint given, or a tool choice's
    from gateway.tools import tool_mode

    spaced = msgspec.convert({"prompt": "x", "guided_json": {"type": "object"}, "guided_whitespace_pattern": ""},
                             CompletionRequest)
    assert gateway._grammar(spaced, None) == grammar_of({"guided_json": {"type": "object"}}, whitespace_pattern="")
    _, tool_constraint = tool_mode([{"type": "function", "function": {"name": "f"}}], "required", None, None)
    plain = msgspec.convert({"prompt": "x", "guided_whitespace_pattern": ""}, CompletionRequest)
    assert gateway._grammar(plain, tool_constraint) == grammar_of(tool_constraint, whitespace_pattern="")
    gateway.grammar_tokenizer, gateway.grammar_unavailable = None, "no tokenizer.json in /m"
    with pytest.raises(HTTPError) as e:
        gateway._grammar(body, None)
    assert e.value.status == 400 and e.value.param == "guided_choice" and "tokenizer.json" in e.value.message


def test_a_constraint_that_fails_part_way_ends_the_request_with_an_error(model, tmp_path):
    """A pattern llguidance accepts but whose lexer outgrows its limits part way through the answer: the
    matcher then allows only the end of sequence. That is a failure, not a whole answer: the state says
    why, the step's token carries it, and the request ends with an error (here a worker without the
    model's tokenizer, which fails at the first token, through the engine)."""
    import shutil

    from moemesh.config import ModelConfig
    from stage_worker.grammar import Grammars

    eos = ModelConfig.from_dir(model).eos_token_ids
    grammars = Grammars(model, SPEC.vocab_size, eos)
    tokenizer = grammars.tokenizer()
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^((a{1,100}){1,100}){1,100}$"}},
              "required": ["s"], "additionalProperties": False}
    grammar = grammar_of({"guided_json": schema}, tokenizer)
    a = tokenizer.tokenize_str("a")
    tokens, state = tokenizer.tokenize_str('{"s": "'), None
    for _ in range(200):
        state, mask = grammars.allowed(state, grammar, tokens, seq_id=1)
        if state.error is not None:
            break
        assert mask[a[0]], "the pattern allows another a"
        tokens = tokens + a
    assert state.error is not None and mask.nonzero().view(-1).tolist() == sorted(eos)[:1]
    blind = tmp_path / "no-tokenizer"
    shutil.copytree(model, blind)
    (blind / "tokenizer.json").unlink()
    engine = _engine(blind)
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], [
        SamplingParams(max_tokens=8, temperature=0, grammar=grammar_of({"guided_choice": ["yes"]})),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)])
    assert [o.finish_reason for o in outs] == ["error", "length"]


def test_a_constraint_failing_inside_a_schedule_of_several_steps_ends_at_its_token(model, monkeypatch):
    """With --num-scheduler-steps, a constraint that fails at its sixth token (a burst's second decode
    step) ends the request there with an error; one that completes in a burst still ends as "stop"."""
    from stage_worker.grammar import Grammars

    allowed = Grammars.allowed

    def failing_at_six(self, state, grammar, outputs, seq_id):
        state, mask = allowed(self, state, grammar, outputs, seq_id)
        if len(outputs) >= 5 and "fail" in grammar:
            self._fail(state, seq_id, "planted")
            mask = self._end_only()
        return state, mask

    monkeypatch.setattr(Grammars, "allowed", failing_at_six)
    engine = _engine(model, num_scheduler_steps=4)
    failing = grammar_of({"guided_regex": "(fail)?[a-z ]{0,40}"})
    done = grammar_of({"guided_choice": ["yes"]})
    outs = engine.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, grammar=failing),
        SamplingParams(max_tokens=12, temperature=0, grammar=done),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])
    assert [o.finish_reason for o in outs] == ["error", "stop", "length"]
    assert len(outs[0].token_ids) == 6 and _text(model, outs[1].token_ids[:-1]) == "yes"
