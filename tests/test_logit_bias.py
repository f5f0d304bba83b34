"""logit_bias (OpenAI's), allowed_token_ids and bad_words (vLLM's): the last stage adds the biases to
a row's logits, masks the tokens outside the allowed set and bans the tokens that would complete a
bad word before it samples, so greedy decoding matches
transformers' logits edited alike, step by step, in each pipeline layout and with several decode
steps per schedule; logprobs stay the model's own. Through the gateway: tests/test_gateway.py."""

from __future__ import annotations

import pytest
import torch

from moemesh.entrypoints.tiny_model import write_tiny_model
from moemesh.sampling import SamplingParams
from stage_worker.sampler import SampleRow, TokenEdits, sample
from test_structured import PROMPTS, SPEC, _engine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(SPEC, tmp_path_factory.mktemp("bias") / "tiny-mixtral")


@pytest.fixture(scope="module")
def oracle(model):
    """Greedy tokens of transformers' model with each step's logits biased and masked as the params
    say (the first maximum taken), stopping at EOS."""
    from transformers import AutoModelForCausalLM

    from moemesh.config import ModelConfig

    hf = AutoModelForCausalLM.from_pretrained(model, attn_implementation="eager", dtype=torch.float32).eval()
    eos = ModelConfig.from_dir(model).eos_token_ids

    def greedy(prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        with torch.no_grad():
            while len(tokens) < params.max_tokens:
                logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].float()
                if params.allowed_token_ids is not None:
                    keep = torch.zeros_like(logits, dtype=torch.bool)
                    keep[list(params.allowed_token_ids)] = True
                    logits = logits.masked_fill(~keep, float("-inf"))
                for word in params.bad_words:
                    if len(word) == 1 or tuple(tokens[-(len(word) - 1):]) == word[:-1]:
                        logits[word[-1]] = float("-inf")
                for token, bias in params.logit_bias:
                    logits[token] += bias
                tokens.append(int(logits.argmax()))
                if tokens[-1] in eos and not params.ignore_eos:
                    break
        return tokens

    return greedy


def _cases(engine) -> list[tuple[list[int], SamplingParams]]:
    """Biases and masks that change the greedy answer: the plain answer's own tokens pushed down, a
    few others pulled up, an allowed set without the plain answer's first token, and both at once."""
    plain = engine.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    cases = []
    for prompt, out in zip(PROMPTS, plain):
        first = out.token_ids[0]
        down = tuple((t, -7.5) for t in dict.fromkeys(out.token_ids[:4]))
        allowed = tuple(t for t in range(0, SPEC.vocab_size, 7) if t != first)
        cases += [(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                          logit_bias=down + ((11, 2.0), (300, 3.5)))),
                  (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, allowed_token_ids=allowed)),
                  (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, allowed_token_ids=allowed,
                                          logit_bias=((allowed[3], 4.0),))),
                  (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,  # (its 2nd and 3rd tokens,
                                          bad_words=(tuple(out.token_ids[1:3]), (out.token_ids[5],))))]  # its 6th)
    return cases


@pytest.mark.parametrize("cfg", [{"pp": 1}, {"pp": 2}, {"num_scheduler_steps": 4}])
def test_greedy_with_biases_and_allowed_tokens_matches_transformers_edited_alike(model, oracle, cfg):
    """Each edited request token for token the oracle's, in one batch with a plain greedy request
    (which keeps the fast greedy path of its own)."""
    engine = _engine(model, **cfg)
    cases = _cases(engine)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = engine.generate([p for p, _ in cases] + [PROMPTS[2]], [sp for _, sp in cases] + [plain])
    for (prompt, sp), out in zip(cases, outs):
        assert out.token_ids == oracle(prompt, sp), sp
        if sp.allowed_token_ids is not None:
            assert set(out.token_ids) <= set(sp.allowed_token_ids)
    assert outs[-1].token_ids == oracle(PROMPTS[2], plain)
    alone = engine.generate([cases[0][0]], [cases[0][1]])[0]  # (a batch of edited rows alone: no fast path)
    assert alone.token_ids == outs[0].token_ids
    assert any(out.token_ids != oracle(prompt, plain) for (prompt, _), out in zip(cases, outs))


def test_the_sampler_biases_masks_and_reports_the_models_own_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    top = int(logits[0].argmax())
    rows = [SampleRow(SamplingParams(temperature=0, logprobs=1, logit_bias=((top, -100.0), (7, 1.0), (7, 1.0))), [1],
                      []),
            SampleRow(SamplingParams(temperature=1.0, seed=3, allowed_token_ids=(4, 9, 49, 50_000)), [1], []),
            SampleRow(SamplingParams(temperature=0, allowed_token_ids=(60, 70)), [1], [])]  # (none in the vocabulary)
    tokens, logprobs = sample(logits.clone(), rows)
    biased = logits[0].clone()
    biased[top] -= 100
    biased[7] += 2  # (a token given twice: both biases)
    assert tokens[0] == int(biased.argmax()) != top
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]))  # (unbiased)
    assert tokens[1] in (4, 9, 49)
    assert tokens[2] == int(logits[2].argmax())  # (nothing the vocabulary has to keep to: the mask is dropped)
    for seed in range(20):  # sampled rows stay inside the set
        row = SampleRow(SamplingParams(temperature=2.0, seed=seed, allowed_token_ids=(4, 9)), [1], [])
        assert sample(logits[1:2].clone(), [row])[0][0] in (4, 9)
    words = TokenEdits.of(SamplingParams(bad_words=((7,), (3, 4), (1, 2, 5), (6, 2, 5))), 50)
    assert words.banned_next([]) == [7]
    assert words.banned_next([9, 3]) == [4, 7] and words.banned_next([1, 2]) == [5, 7]
    assert words.banned_next([2]) == [7]  # (a prefix longer than the output: not yet)
    assert TokenEdits.of(SamplingParams(bad_words=((3, 60),)), 50).banned_next([3]) == []  # (beyond the vocabulary)
    only = SampleRow(SamplingParams(temperature=0, allowed_token_ids=(7,), bad_words=((7,),)), [1], [])
    assert sample(logits[:1].clone(), [only])[0] == [7]  # (a ban that would leave nothing is not made)
    # a bad word's ban, then min_tokens' ban of the stop token, inside an allowed set: the second would
    # leave nothing, so it is not made (the row never samples outside its set)
    for temperature in (0, 1.0):
        both = SampleRow(SamplingParams(temperature=temperature, seed=1, allowed_token_ids=(7, 9), stop_token_ids=(9,),
                                        bad_words=((7,),), min_tokens=1, max_tokens=2), [1], [])
        assert sample(logits[:1].clone(), [both])[0] == [9]
    grammar = torch.zeros(50, dtype=torch.bool)
    grammar[[5, 6]] = True
    both = SampleRow(SamplingParams(temperature=0, allowed_token_ids=(6, 8)), [1], [], allowed=grammar)
    assert sample(logits[:1].clone(), [both])[0] == [6]  # (in both)
    apart = SampleRow(SamplingParams(temperature=0, allowed_token_ids=(8,)), [1], [], allowed=grammar)
    assert sample(logits[:1].clone(), [apart])[0][0] in (5, 6)  # (none in both: the grammar's alone)


@pytest.mark.parametrize("bad", [dict(logit_bias=((5, 101.0),)), dict(logit_bias=((-1, 1.0),)),
                                 dict(logit_bias=tuple((t, 1.0) for t in range(1025))),
                                 dict(allowed_token_ids=()), dict(allowed_token_ids=(-3,)), dict(bad_words=((),)),
                                 dict(bad_words=(tuple(range(65)),)), dict(bad_words=((5, -1),))])
def test_sampling_params_refuse_biases_and_sets_a_worker_could_not_use(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
