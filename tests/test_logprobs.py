"""Logprobs, prompt logprobs, penalties and min_tokens of the in-process engine, against the
Hugging Face transformers model they should agree with (a tiny mixtral checkpoint, on CPU).

The references are computed by hand from transformers' logits: log_softmax for the logprobs, and
for penalties and min_tokens one greedy step at a time over the full context (prompt + tokens so
far), with transformers' own RepetitionPenaltyLogitsProcessor where it has one.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_model, hf_greedy, hf_logits
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.protocol import RequestOutput
from moemesh.sampling import SamplingParams
from stage_worker.sampler import SampleRow, _apply_penalties

PROMPT = [5, 17, 33, 2, 9, 100, 41, 7, 250, 3]
OTHER = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 250, 251, 3, 4]
TOL = 1e-4
K = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return path, build_hf_model("mixtral", path)


def make_engine(path, **cfg) -> LLMEngine:
    return LLMEngine(EngineSettings(model=str(path), num_kv_blocks=64, **cfg), progress=False)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], first_step=None):
    """-> {request id: (sequence, [RequestOutput, ...])}, all requests in one batch.
    first_step: a dict to fill with the index of the step that brought each request's first output."""
    seqs = {rid: engine.add_request(p, sp, request_id=rid) for rid, (p, sp) in requests.items()}
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for step in range(1000):
        if not engine.core.has_work():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
            if first_step is not None:
                first_step.setdefault(out.request_id, step)
    assert not engine.core.has_work()
    return {rid: (seqs[rid], outputs[rid]) for rid in requests}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **{"ignore_eos": True, **kw})


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1)


def check_entry(entry, token: int, ref_row: torch.Tensor, k: int) -> None:
    """One TokenLogprobs against a reference log-softmax row."""
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(ref_row[token].item(), abs=TOL)
    ref_top = ref_row.topk(k)
    assert [t for t, _ in entry.top] == ref_top.indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(ref_top.values.tolist(), abs=TOL)


# -- (a) logprobs of sampled tokens -------------------------------------------------------------

def test_logprobs_of_greedy_tokens_match_transformers(checkpoint):
    path, hf = checkpoint
    n = 12
    res = run(make_engine(path), {"a": (PROMPT, greedy(max_tokens=n, logprobs=K)),
                                  "b": (OTHER, greedy(max_tokens=n, logprobs=1))})
    for rid, prompt, k in (("a", PROMPT, K), ("b", OTHER, 1)):
        seq, outs = res[rid]
        tokens = seq.output_ids
        assert tokens == hf_greedy(hf, prompt, n)
        ref = log_softmax(hf_logits(hf, prompt + tokens))
        streamed = [lp for o in outs for lp in o.logprobs]
        assert streamed == seq.logprobs and len(streamed) == n
        for i, (token, entry) in enumerate(zip(tokens, streamed)):
            check_entry(entry, token, ref[len(prompt) - 1 + i], k)
            assert entry.top[0][0] == token  # greedy: the sampled token is the top one
            assert entry.logprob == entry.top[0][1]


def test_logprobs_zero_gives_the_token_alone(checkpoint):
    path, hf = checkpoint
    (seq, outs), = run(make_engine(path), {"a": (PROMPT, greedy(max_tokens=3, logprobs=0))}).values()
    ref = log_softmax(hf_logits(hf, PROMPT + seq.output_ids))
    assert [lp.top for lp in seq.logprobs] == [[], [], []]
    for i, lp in enumerate(seq.logprobs):
        assert lp.logprob == pytest.approx(ref[len(PROMPT) - 1 + i, seq.output_ids[i]].item(), abs=TOL)


def test_no_logprobs_unless_asked(checkpoint):
    path, _ = checkpoint
    (seq, outs), = run(make_engine(path), {"a": (PROMPT, greedy(max_tokens=3))}).values()
    assert seq.logprobs == [] and all(o.logprobs is None and o.prompt_logprobs is None for o in outs)


def test_sampled_logprobs_are_of_the_model_distribution(checkpoint):
    """With temperature and top-k the reported logprob is still log_softmax of the raw logits."""
    path, hf = checkpoint
    params = SamplingParams(temperature=0.7, top_k=3, seed=7, max_tokens=6, ignore_eos=True, logprobs=2)
    (seq, _), = run(make_engine(path), {"a": (PROMPT, params)}).values()
    ref = log_softmax(hf_logits(hf, PROMPT + seq.output_ids))
    for i, (token, entry) in enumerate(zip(seq.output_ids, seq.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        check_entry(entry, token, row, 2)
        assert token in row.topk(3).indices.tolist()  # top_k=3 held


# -- (b) prompt logprobs ------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [512, 5, 3], ids=["one-chunk", "chunks-of-5", "chunks-of-3"])
def test_prompt_logprobs_match_transformers(checkpoint, budget):
    path, hf = checkpoint
    engine = make_engine(path, max_batched_tokens=budget)
    # a decoding neighbour shares the steps with the prompt's chunks
    prompt = PROMPT + OTHER
    first_step = {}
    res = run(engine, {"other": (OTHER[:3], greedy(max_tokens=8, logprobs=1)),
                       "a": (prompt, greedy(max_tokens=2, prompt_logprobs=K))}, first_step)
    # the prompt was prefilled in at least this many chunks (its neighbour shares the budget)
    assert first_step["a"] >= -(-len(prompt) // budget) - 1
    assert (first_step["a"] == 0) == (budget >= len(prompt) + 3)
    seq, outs = res["a"]
    first, *rest = outs
    ref = log_softmax(hf_logits(hf, prompt))
    plp = first.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        check_entry(plp[pos], prompt[pos], ref[pos - 1], K)
        # its rank: the tokens at least as likely, itself included (with a tolerance for near-ties)
        row, value = ref[pos - 1], ref[pos - 1][prompt[pos]]
        assert int((row >= value + TOL).sum()) + 1 <= plp[pos].rank <= int((row >= value - TOL).sum())
    assert all(o.prompt_logprobs is None for o in rest)
    assert seq.output_ids == hf_greedy(hf, prompt, 2)
    assert res["other"][0].output_ids == hf_greedy(hf, OTHER[:3], 8)
    assert res["other"][1][0].prompt_logprobs is None  # it did not ask
    assert [len(o.token_ids) for o in outs] == [1, 1]  # chunks without a sample produced no output


def test_logprobs_survive_preemption_and_recomputation(checkpoint):
    """A pool too small for four sequences: they are preempted and recomputed from their prompts,
    and neither the prompt logprobs nor the per-token logprobs are lost, doubled or shifted."""
    path, hf = checkpoint
    engine = LLMEngine(EngineSettings(model=str(path), num_kv_blocks=6, block_size=4, max_batched_tokens=8),
                       progress=False)
    prompts = {f"r{i}": list(range(10 + 7 * i, 23 + 7 * i)) for i in range(4)}
    n = 6
    res = run(engine, {rid: (p, greedy(max_tokens=n, logprobs=2, prompt_logprobs=2)) for rid, p in prompts.items()})
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        seq, outs = res[rid]
        assert seq.output_ids == hf_greedy(hf, prompt, n)
        ref = log_softmax(hf_logits(hf, prompt + seq.output_ids))
        plp = outs[0].prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for pos in range(1, len(prompt)):
            check_entry(plp[pos], prompt[pos], ref[pos - 1], 2)
        streamed = [lp for o in outs for lp in o.logprobs]
        assert len(streamed) == n
        for i, (token, entry) in enumerate(zip(seq.output_ids, streamed)):
            check_entry(entry, token, ref[len(prompt) - 1 + i], 2)


def test_prompt_logprobs_zero_and_a_one_token_prompt(checkpoint):
    path, hf = checkpoint
    res = run(make_engine(path), {"one": ([42], greedy(max_tokens=1, prompt_logprobs=3)),
                                  "zero": (PROMPT, greedy(max_tokens=1, prompt_logprobs=0))})
    assert res["one"][1][0].prompt_logprobs == [None]
    plp = res["zero"][1][0].prompt_logprobs
    ref = log_softmax(hf_logits(hf, PROMPT))
    assert plp[0] is None and all(e.top == [] for e in plp[1:])
    assert [e.token_id for e in plp[1:]] == PROMPT[1:]
    assert [e.logprob for e in plp[1:]] == pytest.approx(
        [ref[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))], abs=TOL)


# -- (c) penalties ------------------------------------------------------------------------------

def hf_repetition(penalty: float, context: list[int], logits: torch.Tensor) -> torch.Tensor:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([context]), logits.clone().unsqueeze(0))[0]


def reference_penalized_greedy(hf, prompt, n, repetition=1.0, presence=0.0, frequency=0.0) -> list[int]:
    """Greedy by hand: HF's repetition processor over prompt + output, then presence and frequency
    over the output alone (vLLM's order and scope)."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(hf, prompt + out)[-1]
        if repetition != 1:
            logits = hf_repetition(repetition, prompt + out, logits)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        out.append(int(logits.argmax()))
    return out


def test_repetition_penalty_of_one_row_is_transformers_processor(checkpoint):
    """The whole penalized row, positive and negative logits, over prompt and output tokens."""
    _, hf = checkpoint
    context = PROMPT + [133, 148, 5]
    logits = hf_logits(hf, context)[-1]
    for penalty in (1.7, 0.5):
        row = logits.clone()
        _apply_penalties(row, SampleRow(SamplingParams(repetition_penalty=penalty), PROMPT, [133, 148, 5]),
                         row.shape[0])
        expected = hf_repetition(penalty, context, logits)
        torch.testing.assert_close(row, expected, rtol=0, atol=1e-6)
        seen = sorted(set(context))
        assert (logits[seen] > 0).any() and (logits[seen] < 0).any()  # both branches were exercised
        assert not torch.equal(row, logits)


@pytest.mark.parametrize("penalties", [
    dict(presence=2.0), dict(frequency=1.5), dict(repetition=3.0),
    dict(repetition=1.3, presence=1.0, frequency=0.5),
], ids=["presence", "frequency", "repetition", "all"])
def test_penalized_greedy_matches_a_reference_from_transformers_logits(checkpoint, penalties):
    path, hf = checkpoint
    n = 16
    params = greedy(max_tokens=n, logprobs=1, repetition_penalty=penalties.get("repetition", 1.0),
                    presence_penalty=penalties.get("presence", 0.0),
                    frequency_penalty=penalties.get("frequency", 0.0))
    (seq, _), = run(make_engine(path), {"a": (PROMPT, params)}).values()
    plain = hf_greedy(hf, PROMPT, n)
    assert len(set(plain)) < n  # plain greedy repeats itself on this prompt ...
    assert seq.output_ids == reference_penalized_greedy(hf, PROMPT, n, **penalties)
    assert seq.output_ids != plain  # ... and the penalty changed that
    assert len(set(seq.output_ids)) == n  # strong enough here that nothing repeats
    # logprobs stay those of the model's own distribution, before the penalties
    ref = log_softmax(hf_logits(hf, PROMPT + seq.output_ids))
    for i, (token, lp) in enumerate(zip(seq.output_ids, seq.logprobs)):
        assert lp.logprob == pytest.approx(ref[len(PROMPT) - 1 + i, token].item(), abs=TOL)


def test_repetition_penalty_counts_the_prompt_presence_does_not(checkpoint):
    """A prompt that ends where greedy repeats one of its own tokens next."""
    path, hf = checkpoint
    plain = hf_greedy(hf, PROMPT, 6)
    prompt = PROMPT + plain[:5]
    repeat = hf_greedy(hf, prompt, 1)[0]
    assert repeat in prompt
    logits = hf_logits(hf, prompt)[-1]
    expected = int(hf_repetition(3.0, prompt, logits).argmax())
    assert expected != repeat
    res = run(make_engine(path), {
        "repetition": (prompt, greedy(max_tokens=1, repetition_penalty=3.0)),
        "presence": (prompt, greedy(max_tokens=1, presence_penalty=2.0, frequency_penalty=2.0)),
    })
    assert res["repetition"][0].output_ids == [expected]
    assert res["presence"][0].output_ids == [repeat]  # no output yet: nothing to penalize


def test_a_negative_presence_penalty_encourages_repeats(checkpoint):
    path, hf = checkpoint
    n = 8
    (seq, _), = run(make_engine(path), {"a": (PROMPT, greedy(max_tokens=n, presence_penalty=-2.0))}).values()
    assert seq.output_ids == reference_penalized_greedy(hf, PROMPT, n, presence=-2.0)
    assert len(set(seq.output_ids)) < len(set(hf_greedy(hf, PROMPT, n)))


# -- (d) min_tokens -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory, checkpoint):
    """The same weights, with EOS set to a token plain greedy picks early (and not before)."""
    _, hf = checkpoint
    plain = hf_greedy(hf, PROMPT, 16)
    j = next(i for i in range(2, 16) if plain[i] not in plain[:i])
    eos = plain[j]
    path = tmp_path_factory.mktemp("mixtral-eos")
    hf_eos = build_hf_model("mixtral", path, eos_token_id=eos)
    assert torch.equal(hf_logits(hf_eos, PROMPT), hf_logits(hf, PROMPT))
    return path, hf, eos, j


def reference_min_tokens(hf, prompt, eos, min_tokens, max_tokens) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        logits = hf_logits(hf, prompt + out)[-1]
        if len(out) < min_tokens:
            logits[eos] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


def test_eos_stops_greedy_where_transformers_picks_it(eos_checkpoint):
    path, hf, eos, j = eos_checkpoint
    engine = make_engine(path)
    assert eos in engine.model_config.eos_token_ids
    (seq, outs), = run(engine, {"a": (PROMPT, SamplingParams(temperature=0, max_tokens=16))}).values()
    assert seq.output_ids == hf_greedy(hf, PROMPT, j + 1)
    assert seq.output_ids[-1] == eos and seq.finish_reason == "stop" and outs[-1].finish_reason == "stop"


@pytest.mark.parametrize("extra", [1, 4])
def test_min_tokens_holds_eos_back(eos_checkpoint, extra):
    path, hf, eos, j = eos_checkpoint
    min_tokens, max_tokens = j + extra, 24
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=1)
    (seq, _), = run(make_engine(path), {"a": (PROMPT, params)}).values()
    out = seq.output_ids
    assert eos not in out[:min_tokens]
    assert len(out) > j + 1  # it did not stop where plain greedy would have
    assert out == reference_min_tokens(hf, PROMPT, eos, min_tokens, max_tokens)
    assert (seq.finish_reason == "stop") == (out[-1] == eos)
    # at step j the model still prefers EOS: the logprob report shows it, the sample does not take it
    assert seq.logprobs[j].top[0][0] == eos and out[j] != eos
