"""Speculative decoding by prompt lookup (--num-speculative-tokens): the n-gram index against a plain
search, the scheduler's and the core's bookkeeping with a fabricated last stage, then the engine
against itself without drafts (the output never changes, whatever the drafts are: the model's own
guesses, the true continuation, or wrong ones), on the fused path and the op-by-op one.

Greedy parity with transformers with drafts is in test_model_parity.py (the "speculative" layout),
and through a pipeline of two stages in test_mesh.py."""

from __future__ import annotations

import random

import pytest

from coordinator.core import EngineCore
from coordinator.ngram import NgramConfig, NgramIndex
from coordinator.scheduler import SchedulerConfig
from hf_models import build_hf_model
from moemesh.entrypoints.engine import LLMEngine
from moemesh.errors import ConfigError
from moemesh.protocol import SampledToken, Schedule, StepResult
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings

EOS = 0
VOCAB = 1000


# -- the n-gram index ---------------------------------------------------------------------------

class Tokens(list):
    """A token list as the index reads a sequence."""

    @property
    def num_tokens(self) -> int:
        return len(self)

    def tokens(self, start: int, end: int) -> list[int]:
        return self[start:end]


def searched(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """What NgramIndex.propose should give, by a plain search: the longest suffix (hi down to lo
    tokens) that occurred before, at its latest occurrence; the k tokens after it, the text taken as
    repeating with the period L - e past its end."""
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n:e] == tokens[L - n:]:
                return [tokens[e + j] if e + j < L else tokens[e + (j % (L - e))] for j in range(k)]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_the_index_proposes_what_a_plain_search_finds_as_the_tokens_grow(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 2)
    hi = lo + rng.randint(0, 3)
    index, tokens = NgramIndex(lo, hi), Tokens()
    alphabet = rng.randint(2, 6)  # few distinct tokens: matches of every length
    for _ in range(60):
        tokens += [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]
        k = rng.randint(1, 5)
        assert index.propose(tokens, k) == searched(list(tokens), k, lo, hi), (tokens, k, lo, hi)


def test_the_longest_match_wins_and_its_latest_occurrence():
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 2, 3]
    assert index.propose(Tokens(tokens), 2) == [8, 7]  # [2, 3] last ended at 6: its tokens after
    assert NgramIndex(1, 3).propose(Tokens([1, 2, 3, 5, 2, 3]), 3) == [5, 2, 3]  # (a draft may run into the suffix)
    assert NgramIndex(1, 3).propose(Tokens([7, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]  # (and on, with its period)
    assert NgramIndex(2, 3).propose(Tokens([4, 5, 6, 7]), 3) == []  # nothing repeats
    assert NgramIndex(1, 1).propose(Tokens([4]), 3) == []


# -- the scheduler and the core, with a fabricated last stage -----------------------------------

def make_core(k=3, lo=1, hi=3, max_batch=None, num_blocks=64, block_size=4, budget=64, max_model_len=512,
              sampled=False):
    return EngineCore(SchedulerConfig(budget, 16, max_model_len, ngram=NgramConfig(k, lo, hi, max_batch, sampled)),
                      num_blocks, block_size, (EOS,), VOCAB)


class Oracle:
    """A last stage whose model continues every sequence with `truth[seq]` (and 900 after it): a draft
    token is kept while it is the truth; the first that is not is replaced by the truth."""

    def __init__(self, truth: dict[int, list[int]]):
        self.truth, self.made = truth, {s: 0 for s in truth}
        self.drafts: list[tuple[int, list[int]]] = []

    def next(self, seq_id: int) -> int:
        truth, i = self.truth[seq_id], self.made[seq_id]
        return truth[i] if i < len(truth) else 900

    def __call__(self, sched: Schedule) -> StepResult:
        sampled = []
        for w in sched.seqs:
            if not w.sample:
                continue
            guesses = w.token_ids[len(w.token_ids) - w.draft:] if w.draft else []
            self.drafts.append((w.seq_id, guesses))
            for g in [*guesses, None]:
                t = self.next(w.seq_id)
                sampled.append(SampledToken(w.seq_id, t))
                self.made[w.seq_id] += 1
                if t != g:
                    break
        return StepResult(sched.step_id, sampled)


def drive(core: EngineCore, stage, max_steps=200):
    outputs = {}
    for _ in range(max_steps):
        sched = core.next_schedule()
        if sched is None:
            break
        for out in core.process_result(stage(sched)):
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
    assert not core.has_work()
    return outputs


def test_a_repeating_sequence_takes_its_drafts_and_keeps_the_right_ones():
    core = make_core(k=3)
    prompt = [5, 6, 7, 8, 5, 6]
    seq = core.add("a", prompt, SamplingParams(max_tokens=9, temperature=0))
    stage = Oracle({seq.seq_id: [7, 8, 5, 6, 7, 1, 2, 3, 4]})
    out = drive(core, stage)
    assert out["a"] == [7, 8, 5, 6, 7, 1, 2, 3, 4]
    # the prefill samples 7; [5, 6, 7] occurred before: [8, 5, 6] drafted, all kept, and 7 after them;
    # [5, 6, 7] again (latest at 4..6): [8, 5, 6], the 8 refused for 1; nothing repeats after that
    assert [g for _, g in stage.drafts] == [[], [8, 5, 6], [8, 5, 6], [], [], []]
    assert (core.scheduler.num_drafts, core.scheduler.num_drafted, core.scheduler.num_accepted) == (2, 6, 3)
    assert core.blocks.num_free == core.blocks.num_blocks


def test_the_cache_goes_back_to_what_the_kept_tokens_computed():
    core = make_core(k=3)
    seq = core.add("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, temperature=0))
    stage = Oracle({seq.seq_id: [3, 1, 9, 9, 9, 9]})
    core.process_result(stage(core.next_schedule()))  # the prefill: 3
    sched = core.next_schedule()
    (w,) = sched.seqs
    assert w.draft == 3 and w.token_ids == [3, 1, 2, 3] and w.context_len == 5
    assert seq.num_pending == 0  # (awaiting its result, as a decode would)
    core.process_result(stage(sched))  # keeps 1, refuses 2 (the truth is 9): tokens 1, 9
    assert seq.output_ids == [3, 1, 9]
    assert seq.num_computed == 7 == seq.num_tokens - 1  # the input 3 and the kept draft 1
    sched = core.next_schedule()
    assert sched.seqs[0].context_len == 7 and sched.seqs[0].token_ids[0] == 9


def test_drafts_stay_within_max_tokens_the_context_and_the_budget():
    core = make_core(k=8, budget=64)
    seq = core.add("a", [1, 2, 1, 2, 1, 2, 1], SamplingParams(max_tokens=4, temperature=0))
    stage = Oracle({seq.seq_id: [2, 1, 2, 1]})
    assert drive(core, stage)["a"] == [2, 1, 2, 1]
    # one sampled by the prefill, then 3 more at most: 1 + 2 drafts, all kept
    assert [g for _, g in stage.drafts] == [[], [1, 2]]
    core = make_core(k=8, budget=3)
    seq = core.add("c", [1, 2] * 4, SamplingParams(max_tokens=12, temperature=0))
    stage = Oracle({seq.seq_id: [1, 2] * 6})
    assert drive(core, stage)["c"] == [1, 2] * 6
    assert max(len(g) for _, g in stage.drafts) == 2  # the step's budget of 3 tokens: the input and 2 drafts


@pytest.mark.parametrize("params", [dict(temperature=0.7, seed=1), dict(temperature=0, logprobs=1),
                                    dict(temperature=0, repetition_penalty=1.2), dict(temperature=0, logit_bias=((3, 1.0),)),
                                    dict(temperature=0, min_tokens=8)],
                         ids=["seeded", "logprobs", "penalty", "logit_bias", "min_tokens"])
def test_only_greedy_or_unseeded_decodes_with_nothing_edited_carry_drafts(params):
    core = make_core(k=3)
    seq = core.add("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=8, **params))
    stage = Oracle({seq.seq_id: [2, 1, 2, 1, 2, 1, 2, 1]})
    drive(core, stage)
    assert len(stage.drafts) == 8 and not any(g for _, g in stage.drafts)


def test_no_drafts_while_more_sequences_run_than_max_batch():
    core = make_core(k=3, max_batch=1)
    a = core.add("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=6, temperature=0))
    b = core.add("b", [1, 2, 1, 2, 1], SamplingParams(max_tokens=3, temperature=0))
    stage = Oracle({a.seq_id: [2, 1] * 3, b.seq_id: [2, 1, 2]})
    drive(core, stage)
    by = {}
    for s, g in stage.drafts:
        by.setdefault(s, []).append(g)
    assert by[b.seq_id] == [[], [], []]  # two running: no drafts
    assert not any(by[a.seq_id][:3]) and by[a.seq_id][3]  # alone after b ends: drafts


def test_a_stop_token_among_the_kept_ends_the_sequence_there():
    core = make_core(k=3)
    seq = core.add("a", [4, 5, 6, 4, 5], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[4]))
    stage = Oracle({seq.seq_id: [6, 4, 5, 6]})  # the draft [6, 4, 5] after 5: 6 kept, then the stop token 4
    out = drive(core, stage)
    assert out["a"] == [6, 4] and seq.finish_reason == "stop"
    assert core.blocks.num_free == core.blocks.num_blocks


def test_drafts_never_take_the_blocks_other_sequences_need():
    # 2-token blocks, a pool of 6: a needs 4 blocks in the end, b 3, and b ends before a needs its last.
    # After their prefills two blocks are free: a's draft of 3 would take both (positions 4..7), and b's
    # next token would find none; one at a time, each takes one and b is done before a needs more
    core = make_core(k=3, num_blocks=6, block_size=2)
    a = core.add("a", [1, 2, 3, 1], SamplingParams(max_tokens=5, temperature=0))
    b = core.add("b", [7, 8, 9, 7], SamplingParams(max_tokens=3, temperature=0))
    stage = Oracle({a.seq_id: [2, 3, 1, 2, 3], b.seq_id: [8, 9, 7]})
    out = drive(core, stage)
    assert out == {"a": [2, 3, 1, 2, 3], "b": [8, 9, 7]}
    assert core.scheduler.num_preemptions == 0
    assert any(g for s, g in stage.drafts if s == a.seq_id)  # (once b is gone)


def _drafted_decode(k: int):
    """A repeating sequence prefilled (its first token 2), and its first decode's schedule, with a draft:
    (core, seq, its stage, the schedule in flight)."""
    core = make_core(k=k)
    seq = core.add("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=10, temperature=0))
    stage = Oracle({seq.seq_id: [2, 1, 2, 1, 2]})
    core.process_result(stage(core.next_schedule()))
    return core, seq, stage, core.next_schedule()


def test_a_sequence_aborted_while_its_draft_is_in_flight_takes_none_of_it():
    core, seq, stage, sched = _drafted_decode(3)
    assert sched.seqs[0].draft
    core.abort("a")
    assert core.process_result(stage(sched)) == [] and seq.output_ids == [2]
    assert core.blocks.num_free == core.blocks.num_blocks


def test_a_result_the_draft_does_not_allow_is_refused_untouched():
    core, seq, stage, sched = _drafted_decode(2)
    assert sched.seqs[0].draft == 2
    with pytest.raises(ValueError, match="tokens of sequence 0 that its draft does not allow"):
        core.process_result(StepResult(sched.step_id, [SampledToken(seq.seq_id, 2)] * 4))
    assert sched.step_id in core.in_flight and seq.output_ids == [2]
    with pytest.raises(ValueError, match="that its draft does not allow"):  # a token kept that the draft lacks
        core.process_result(StepResult(sched.step_id, [SampledToken(seq.seq_id, 2), SampledToken(seq.seq_id, 1)]))
    assert sched.step_id in core.in_flight and seq.output_ids == [2]
    core.process_result(stage(sched))
    assert seq.output_ids == [2, 1, 2, 1]


# -- the engine: with drafts against without ----------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculative-model")
    build_hf_model("mixtral", path)
    return path


# prompts that repeat themselves, so that the lookup finds matches (some right, some wrong)
PROMPTS = [[(5 * i + 7 * (j % (3 + i))) % 300 + 4 for j in range(6 + 3 * i)] for i in range(6)]


def engine(model_dir, k, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineSettings(model=str(model_dir), block_size=4, num_speculative_tokens=k,
                                    ngram_prompt_lookup_min=1, speculative_disable_by_batch_size=64, **kw),
                     progress=False)


def generate(eng: LLMEngine, params):
    params = params if isinstance(params, list) else [params] * len(PROMPTS)
    seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    while eng.core.has_work():
        eng.step()
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [(s.output_ids, s.finish_reason, [(lp.token_id, round(lp.logprob, 4)) for lp in s.logprobs]) for s in seqs]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


# (float32: in bfloat16 the kernels round a product's input to bfloat16 from four rows on (kernels/
# README.md), so there a sequence's tokens can follow the rows its step has, with drafts as in a batch
# of another size)
@pytest.mark.parametrize("kw", [dict(), dict(moe_backend="torch"), dict(max_batched_tokens=5), dict(pp=2)],
                         ids=["fused", "op-by-op", "chunked", "pp2"])
def test_drafts_leave_greedy_output_as_it_was(model_dir, kw):
    want = generate(engine(model_dir, 0, **kw), GREEDY)
    eng = engine(model_dir, 3, **kw)
    assert generate(eng, GREEDY) == want
    s = eng.scheduler
    assert s.num_drafted > 0 and 0 < s.num_accepted < s.num_drafted  # drafts kept and refused, both


def test_mixed_batches_draft_only_plain_greedy_rows_and_every_row_stays(model_dir):
    greedy = generate(engine(model_dir, 0), GREEDY)
    stop = greedy[3][0][9]
    params = [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=9),
    ]
    want = generate(engine(model_dir, 0), params)
    eng = engine(model_dir, 4)
    assert generate(eng, params) == want
    assert eng.scheduler.num_drafted > 0
    assert want[3][1] == "stop" and len(want[3][0]) == greedy[3][0].index(stop) + 1


@pytest.mark.parametrize("guess", ["true", "wrong"])
def test_whatever_the_drafts_the_tokens_are_the_models(model_dir, guess, monkeypatch):
    """Drafts from an oracle that knows the greedy continuation (every one kept: a step makes 1 + k
    tokens), or drafts that are always wrong (none kept: a step makes 1)."""
    want = generate(engine(model_dir, 0), GREEDY)
    truth = {tuple(p): out for p, (out, _, _) in zip(PROMPTS, want)}

    def propose(self, seq, k):
        tokens = seq.token_ids
        for p, out in truth.items():
            if tuple(tokens[:len(p)]) == p:
                made = len(tokens) - len(p)
                future = out[made:made + k]
                return future if guess == "true" else [(t + 1) % 300 + 4 for t in future]
        raise AssertionError("a sequence of no prompt")

    monkeypatch.setattr(NgramIndex, "propose", propose)
    eng = engine(model_dir, 3)
    assert generate(eng, GREEDY) == want
    s = eng.scheduler
    assert s.num_drafted > 0 and s.num_accepted == (s.num_drafted if guess == "true" else 0)
    if guess == "true":  # the first token from the prefill, then 23 in steps of 4: 6 steps
        assert eng.loop.steps == 1 + 6


def test_blocks_drafted_steps_filled_serve_later_prompts_as_they_would_without(model_dir):
    """Prompts that run on into what a first run generated: their blocks past the first prompts were
    filled by drafted steps (refused drafts' K/V written, then written over), and a prefix cache that
    hashed a block before its K/V were the kept tokens' would give other tokens here."""
    eng = engine(model_dir, 3)  # (4-token blocks)
    first = generate(eng, GREEDY)
    longer = [p + out[:13] for p, (out, _, _) in zip(PROMPTS, first)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    hits = eng.blocks.hits
    got = [o.token_ids for o in eng.generate(longer, params)]
    assert got == [o.token_ids for o in engine(model_dir, 0, no_prefix_caching=True).generate(longer, params)]
    assert eng.blocks.hits - hits > sum(len(p) // 4 * 4 for p in PROMPTS)  # (blocks of generated tokens hit)


def test_a_stop_among_the_kept_tokens_leaves_their_blocks_in_the_cache():
    core = EngineCore(SchedulerConfig(64, 16, 512, ngram=NgramConfig(3, 1, 3)), 64, 2, (EOS,), VOCAB,
                      prefix_caching=True)
    seq = core.add("a", [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[9]))
    stage = Oracle({seq.seq_id: [7, 8, 9, 1]})
    core.process_result(stage(core.next_schedule()))  # the prefill (positions 0..6): 7
    sched = core.next_schedule()
    assert sched.seqs[0].draft == 3 and sched.seqs[0].token_ids == [7, 8, 9, 5]
    core.process_result(stage(sched))  # keeps 8, then the stop token 9: the sequence ends there
    assert seq.finish_reason == "stop" and seq.output_ids == [7, 8, 9]
    # both drafts taken were kept ones (8, and the stop 9): counted accepted, as the sequence's record
    assert (core.scheduler.num_drafted, core.scheduler.num_accepted) == (3, 2)
    assert seq.draft_misses == 0
    # positions 0..8 computed (the prompt, 7 and the kept 8): four full 2-token blocks for the next request
    nxt = core.add("b", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 1], SamplingParams(max_tokens=1, temperature=0))
    assert len(core.blocks.lookup(nxt)) == 4


def test_the_settings_refuse_what_cannot_work(model_dir):
    with pytest.raises(ConfigError, match="--ngram-prompt-lookup-min 3 is more than --ngram-prompt-lookup-max 2"):
        LLMEngine(EngineSettings(model=str(model_dir), num_speculative_tokens=2, ngram_prompt_lookup_min=3,
                                 ngram_prompt_lookup_max=2), progress=False)
    with pytest.raises(ConfigError, match="--num-speculative-tokens and --num-scheduler-steps"):
        LLMEngine(EngineSettings(model=str(model_dir), num_speculative_tokens=2, num_scheduler_steps=4),
                  progress=False)


def test_the_gateway_counts_drafts_as_vllm_does_and_a_new_coordinator_from_zero():
    from prometheus_client import generate_latest

    from gateway.metrics import Metrics
    from moemesh.protocol import StatusReply

    def status(instance, drafts, tokens, accepted):
        return StatusReply(True, 8, 8, 0, 0, 0, [0.0], [0.0], 1.0, 0, instance=instance, spec_drafts=drafts,
                           spec_draft_tokens=tokens, spec_accepted_tokens=accepted)

    def counted(m):
        text = generate_latest(m.registry).decode()
        return [float(next(line.split()[-1] for line in text.splitlines()
                           if line.startswith(f"vllm:spec_decode_num_{name}_total{{")))
                for name in ("drafts", "draft_tokens", "accepted_tokens")]

    m = Metrics("m")
    m.update_from_status(status("a", 2, 6, 3), 1.0)
    m.update_from_status(status("a", 5, 15, 9), 2.0)
    assert counted(m) == [5, 15, 9]
    m.update_from_status(status("b", 1, 3, 1), 3.0)  # a restarted coordinator counts from zero again
    assert counted(m) == [6, 18, 10]


def test_drafts_leave_a_token_of_the_budget_to_each_decode_after_them():
    import dataclasses

    core = make_core(k=3)
    a = core.add("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=10, temperature=0))
    b = core.add("b", [3, 4, 3, 4, 3], SamplingParams(max_tokens=10, temperature=0))
    c = core.add("c", [5, 6, 5, 6, 5], SamplingParams(max_tokens=10, temperature=0))
    stage = Oracle({a.seq_id: [2, 1] * 5, b.seq_id: [4, 3] * 5, c.seq_id: [6, 5] * 5})
    core.process_result(stage(core.next_schedule()))  # the three prefills
    core.scheduler.config = dataclasses.replace(core.scheduler.config, max_num_batched_tokens=4)
    sched = core.next_schedule()
    assert [(w.seq_id, w.draft) for w in sched.seqs] == [(a.seq_id, 1), (b.seq_id, 0), (c.seq_id, 0)]



@pytest.mark.parametrize("sampled", [False, True])
def test_a_sampled_row_unseeded_takes_drafts_where_asked(sampled):
    core = make_core(k=3, sampled=sampled)
    seq = core.add("a", [1, 2, 1, 2, 1], SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9))
    stage = Oracle({seq.seq_id: [2, 1, 2, 1, 2, 1]})
    assert drive(core, stage)["a"] == [2, 1, 2, 1, 2, 1] and any(g for _, g in stage.drafts) == sampled


def _record(accepts, decodes=60):
    """A sequence that repeats itself (so its lookups always find drafts, and the drafts are its true
    continuation) decoded `decodes` times by a stage that keeps accepts(decode) of each draft's tokens
    (and gives the true token after them): how long each decode's draft was (0: none)."""
    core = make_core(k=3, num_blocks=512)
    seq = core.add("a", [1, 2] * 4, SamplingParams(max_tokens=4 * decodes, temperature=0, ignore_eos=True))
    core.process_result(StepResult(core.next_schedule().step_id, [SampledToken(seq.seq_id, 1)]))
    lengths = []
    for step in range(decodes):
        sched = core.next_schedule()
        (w,) = sched.seqs
        lengths.append(w.draft)
        t, tokens = seq.output_ids[-1], []
        for _ in range(min(accepts(step), w.draft) + 1):
            t = 3 - t  # (1, 2, 1, 2 ...)
            tokens.append(t)
        core.process_result(StepResult(sched.step_id, [SampledToken(seq.seq_id, x) for x in tokens]))
    return lengths


def test_drafts_refused_whole_pause_the_sequence_longer_each_time_then_probe():
    lengths = _record(lambda step: 0, decodes=120)
    starts = [i for i, n in enumerate(lengths) if n]
    # each refusal pauses it 1, 2, 4 ... 16 decodes; its record shortens the drafts to one token, then
    # to none worth it: a one-token probe, which pauses 8 (or the refusals' 16, whichever is longer)
    gaps = [b - a - 1 for a, b in zip(starts, starts[1:])]
    assert gaps[:4] == [1, 2, 4, 8] and gaps[4:] and all(g == 16 for g in gaps[4:]), gaps
    assert lengths[starts[0]] == 3 and all(lengths[i] == 1 for i in starts[2:])


def test_drafts_are_as_long_as_the_record_says_they_pay():
    assert set(_record(lambda step: 3, decodes=20)[:-1]) == {3}  # all kept: the whole k, every decode (to max_tokens)
    # one of each draft kept: a rate that pays for one token and then two (r >= 0.3, r^2 < 0.3 at first)
    ones = _record(lambda step: 1, decodes=40)
    assert ones[0] == 3 and set(ones[10:]) <= {1, 2} and all(ones[10:])


# -- speculative sampling's check ---------------------------------------------------------------

def _frequencies(logits, params, draft, n=20000):
    import collections

    import torch

    from stage_worker.sampler import verify_sampled

    g = torch.Generator().manual_seed(0)
    return collections.Counter(tuple(verify_sampled(logits, params, draft, g)) for _ in range(n)), n


def test_each_token_a_check_keeps_is_drawn_as_sampling_it_would_be():
    import torch

    p0, p1 = [0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]
    logits = torch.tensor([p0, p1]).clamp_min(1e-12).log()
    counts, n = _frequencies(logits, SamplingParams(temperature=1.0), [1])
    first = {t: sum(c for ks, c in counts.items() if ks[0] == t) / n for t in range(4)}
    # the first token is p0's whether the draft (1) is kept or replaced: 1 kept with p0(1); else 0 or 2
    assert all(abs(first[t] - p0[t]) < 0.015 for t in range(4)), first
    assert all(len(ks) == 2 for ks in counts if ks[0] == 1) and all(len(ks) == 1 for ks in counts if ks[0] != 1)
    kept = sum(c for ks, c in counts.items() if len(ks) == 2)
    second = {t: counts.get((1, t), 0) / kept for t in range(4)}  # after the kept draft: p1's
    assert all(abs(second[t] - p1[t]) < 0.03 for t in range(4)), second


def test_the_check_samples_from_the_filtered_distribution():
    import torch

    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25] * 4]).clamp_min(1e-12).log()
    # top_k 2 leaves 0.625 / 0.375 of tokens 0 and 1: a draft of 2 is never kept
    counts, n = _frequencies(logits, SamplingParams(temperature=1.0, top_k=2), [2], n=8000)
    assert set(counts) <= {(0,), (1,)} and abs(counts[(0,)] / n - 0.625) < 0.025


def test_unseeded_sampled_requests_take_drafts_and_end_as_asked(model_dir):
    eng = engine(model_dir, 3, speculative_sampling=True)
    out = generate(eng, SamplingParams(max_tokens=24, temperature=0.05, ignore_eos=True))
    assert all(len(tokens) == 24 and reason == "length" for tokens, reason, _ in out)
    assert eng.scheduler.num_drafted > 0 and eng.scheduler.num_accepted > 0



def test_vllms_speculative_config_stands_for_the_flags_and_refuses_what_is_not_served(caplog):
    import logging

    from coordinator.step_loop import ngram_config

    def config(text, **kw):
        return ngram_config(EngineSettings(model="m", speculative_config=json_object(text), **kw))

    from moemesh.settings import json_object

    assert config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}') == \
        NgramConfig(5, 2, 3, 4, False)
    assert config('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, '
                  '"disable_by_batch_size": 16}') == NgramConfig(2, 1, 1, 16, False)
    for text, message in [('{"method": "eagle", "model": "x", "num_speculative_tokens": 2}', "only ngram"),
                          ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
                           "draft_tensor_parallel_size not known here"),
                          ('{"method": "ngram"}', "num_speculative_tokens is required"),
                          ('{"method": "ngram", "num_speculative_tokens": 0}', "must be a positive integer"),
                          ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                           '"prompt_lookup_max": 2}', "--speculative-config's prompt_lookup_min 3 is more than "
                                                      "--speculative-config's prompt_lookup_max 2")]:
        with pytest.raises(ConfigError, match=message):
            config(text)
    with pytest.raises(ConfigError, match="not both"):
        config('{"num_speculative_tokens": 2}', num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="--speculative-sampling .* needs --num-speculative-tokens"):
        ngram_config(EngineSettings(model="m", speculative_sampling=True))  # (it had done nothing, silently)
    with pytest.raises(ConfigError, match="--ngram-prompt-lookup-min 9 is more than --ngram-prompt-lookup-max 4"):
        ngram_config(EngineSettings(model="m", ngram_prompt_lookup_min=9))  # (wrong with drafts off too)
    from coordinator import step_loop

    step_loop._unused.cache_clear()  # (said once a process: an earlier test may have said it)
    logger = logging.getLogger("moemesh.coordinator")
    logger.addHandler(caplog.handler)  # (moemesh's records do not reach the root once a command set up logging)
    try:
        assert ngram_config(EngineSettings(model="m", ngram_prompt_lookup_min=3, speculative_disable_by_batch_size=1)) \
            is None  # (drafts off: said, not refused)
    finally:
        logger.removeHandler(caplog.handler)
    assert "--ngram-prompt-lookup-min, --speculative-disable-by-batch-size given without --num-speculative-tokens" \
        in caplog.text
    assert ngram_config(EngineSettings(model="m")) is None
    with pytest.raises(ConfigError, match="^--speculative-config's num_speculative_tokens and --num-scheduler-steps"):
        config('{"num_speculative_tokens": 2}', num_scheduler_steps=4)  # (named as given)
    with pytest.raises(ConfigError, match="^--speculative-config's prompt_lookup_min 3 is more than "
                                          "--ngram-prompt-lookup-max 2"):  # (one from the JSON, one a flag)
        config('{"num_speculative_tokens": 2, "prompt_lookup_min": 3}', ngram_prompt_lookup_max=2)


def test_the_cli_takes_vllms_speculative_config(model_dir, capsys):
    from moemesh.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--model", str(model_dir), "--speculative-config", "[1]"])
    assert "--speculative-config: invalid JSON object value" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(model_dir), "--prompt-ids", "5,6", "--speculative-config",
              '{"method": "medusa", "num_speculative_tokens": 2}'])
    assert "only ngram" in capsys.readouterr().err
