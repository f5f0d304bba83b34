"""Several decode steps per schedule (--num-scheduler-steps): the scheduler's policy and the core's
bookkeeping with a fabricated stage, then the engine against itself one step at a time (every
sampling feature, both dtypes, the native path and the op-by-op one), and what it refuses.

Greedy parity with transformers in this mode is in test_model_parity.py (the "multi-step" layout)
and through the mesh in test_mesh.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from coordinator.core import EngineCore
from coordinator.scheduler import SchedulerConfig
from hf_models import build_hf_model
from moemesh.entrypoints.engine import LLMEngine
from moemesh.errors import ConfigError
from moemesh.protocol import SampledToken, Schedule, SeqWork, StepResult, TokenLogprobs, max_result_bytes
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings
from test_core import run

EOS = 0
VOCAB = 1000


def make_core(num_steps=4, num_blocks=64, block_size=4, budget=64, max_seqs=16, max_model_len=512):
    return EngineCore(SchedulerConfig(budget, max_seqs, max_model_len, num_steps), num_blocks, block_size, (EOS,),
                      VOCAB)


class FakeStage:
    """Answers schedules as the whole model's stage would: a fresh token per sampling row and
    decode step (or the one scripted for that sequence), logprobs when asked."""

    def __init__(self):
        self.tokens = itertools.count(500)
        self.params: dict[int, SamplingParams] = {}
        self.script: dict[int, list[int]] = {}  # seq id -> its next tokens, in order

    def __call__(self, sched: Schedule) -> StepResult:
        sampled = []
        for _ in range(sched.num_steps):
            for w in sched.seqs:
                if w.params is not None:
                    self.params[w.seq_id] = w.params
                if not w.sample:
                    continue
                script = self.script.get(w.seq_id)
                t = script.pop(0) if script else next(self.tokens)
                lp = self.params[w.seq_id].logprobs
                sampled.append(SampledToken(w.seq_id, t, TokenLogprobs(t, -t / 1000, []) if lp is not None else None))
        return StepResult(sched.step_id, sampled)


def tokens(outputs, rid):
    return [t for out in outputs[rid] for t in out.token_ids]


def test_a_decoding_batch_runs_several_steps_per_schedule_up_to_its_tokens_left():
    core, stage = make_core(num_steps=4), FakeStage()
    core.add("a", [10, 11, 12], SamplingParams(max_tokens=10))
    core.add("b", [20, 21], SamplingParams(max_tokens=10))
    schedules, outputs = run(core, stage)
    # the prefill samples the first token; then 9 more in bursts of 4, 4 and 1
    assert [s.num_steps for s in schedules] == [1, 4, 4, 1]
    assert all(len(out.token_ids) <= 4 for rid in "ab" for out in outputs[rid])
    assert [len(tokens(outputs, rid)) for rid in "ab"] == [10, 10]
    assert outputs["a"][-1].finish_reason == outputs["b"][-1].finish_reason == "length"
    # the result's tokens go to the sequences step by step, each step's in the schedule's order
    assert tokens(outputs, "a")[1:5] == [502, 504, 506, 508] and tokens(outputs, "b")[1:5] == [503, 505, 507, 509]
    assert core.blocks.num_free == core.blocks.num_blocks


def test_the_burst_is_no_longer_than_any_sequence_may_still_produce():
    core, stage = make_core(num_steps=8), FakeStage()
    core.add("short", [10], SamplingParams(max_tokens=3))
    core.add("long", [10], SamplingParams(max_tokens=11))
    schedules, outputs = run(core, stage)
    # 'short' has two tokens left after its prefill: a burst of 2; then 'long' alone, 8 more
    assert [s.num_steps for s in schedules] == [1, 2, 8]
    assert len(tokens(outputs, "short")) == 3 and len(tokens(outputs, "long")) == 11
    assert outputs["long"][-1].finish_reason == "length"


def test_a_waiting_request_or_one_in_prefill_means_single_steps():
    core, stage = make_core(num_steps=4, budget=4), FakeStage()
    core.add("a", [10, 11], SamplingParams(max_tokens=12))
    sched = core.next_schedule()
    core.process_result(stage(sched))
    core.add("b", list(range(10, 20)), SamplingParams(max_tokens=2))  # waits; then prefills in chunks
    seen = []
    while (sched := core.next_schedule()) is not None:
        seen.append((sched.num_steps, {w.seq_id for w in sched.seqs}, max(len(w.token_ids) for w in sched.seqs)))
        core.process_result(stage(sched))
    prefilling = [steps for steps, _, longest in seen if longest > 1]
    assert prefilling and set(prefilling) == {1}
    assert seen[-1][0] > 1  # 'a' alone again, in bursts


def test_a_stop_token_mid_burst_ends_the_sequence_there_and_drops_the_rest():
    core, stage = make_core(num_steps=4), FakeStage()
    a = core.add("a", [10, 11], SamplingParams(max_tokens=20, stop_token_ids=[77]))
    core.add("b", [12, 13], SamplingParams(max_tokens=9))
    sched = core.next_schedule()
    core.process_result(stage(sched))
    stage.script[a.seq_id] = [5, 77, 6, 7]  # the stop token at the burst's second step
    sched = core.next_schedule()
    assert sched.num_steps == 4
    outs = {o.request_id: o for o in core.process_result(stage(sched))}
    assert outs["a"].token_ids == [5, 77] and outs["a"].finish_reason == "stop"
    assert len(outs["b"].token_ids) == 4 and outs["b"].finish_reason is None
    assert a.block_ids == []
    sched = core.next_schedule()
    assert a.seq_id in sched.forget and [w.seq_id for w in sched.seqs] == [1]
    core.process_result(stage(sched))
    assert not core.has_work()
    assert core.blocks.num_free == core.blocks.num_blocks


def test_eos_before_min_tokens_does_not_stop_and_logprobs_stay_aligned():
    core, stage = make_core(num_steps=4), FakeStage()
    a = core.add("a", [10, 11], SamplingParams(max_tokens=9, min_tokens=3, logprobs=1))
    sched = core.next_schedule()
    core.process_result(stage(sched))
    stage.script[a.seq_id] = [EOS, 8, EOS, 9]  # (a real stage bans EOS before min_tokens; this one does not)
    core.process_result(stage(core.next_schedule()))
    assert a.output_ids[1:] == [EOS, 8, EOS] and a.finish_reason == "stop"  # the second EOS is the fourth token
    assert [lp.token_id for lp in a.logprobs] == a.output_ids


def test_a_request_that_waits_for_room_means_single_steps_until_it_is_admitted():
    core, stage = make_core(num_steps=4, max_seqs=1), FakeStage()
    core.add("a", [10], SamplingParams(max_tokens=6))
    core.add("b", [11], SamplingParams(max_tokens=6))  # no room for a second sequence: it waits for 'a'
    steps = []
    while (sched := core.next_schedule()) is not None:
        steps.append((sched.num_steps, [w.seq_id for w in sched.seqs]))
        core.process_result(stage(sched))
    assert steps[:6] == [(1, [0])] * 6  # 'a' decodes one step at a time while 'b' waits
    assert steps[6:] == [(1, [1]), (4, [1]), (1, [1])]


def test_blocks_a_burst_fills_are_shared_as_single_steps_share_them(model_dir):
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    hits = []
    for n in (1, 5):
        eng = engine(model_dir, n)
        (first,) = eng.generate([PROMPTS[5]], params)
        # a request that goes on from the first's output: every full block of it is in the cache
        (second,) = eng.generate([PROMPTS[5] + first.token_ids[:12]], params)
        hits.append((first.token_ids, second.token_ids, eng.blocks.hits))
    assert hits[0] == hits[1] and hits[0][2] == (len(PROMPTS[5]) + 12) // 4 * 4


def test_too_few_free_blocks_for_the_burst_means_one_step():
    core, stage = make_core(num_steps=8, num_blocks=3, block_size=4), FakeStage()
    core.add("a", [10], SamplingParams(max_tokens=7))
    core.add("b", [11], SamplingParams(max_tokens=7))
    sched = core.next_schedule()
    core.process_result(stage(sched))
    # each holds one block of four slots (one used); a burst of 6 needs one more block each, 1 is free
    sched = core.next_schedule()
    assert sched.num_steps == 1
    core.process_result(stage(sched))
    assert core.next_schedule().num_steps == 1


def test_blocks_for_the_whole_burst_go_out_with_its_schedule():
    core, stage = make_core(num_steps=6, block_size=2), FakeStage()
    core.add("a", [10], SamplingParams(max_tokens=20))
    core.process_result(stage(core.next_schedule()))
    sched = core.next_schedule()
    (w,) = sched.seqs
    assert sched.num_steps == 6 and w.context_len == 1 and w.token_ids and w.sample
    # positions 1..6 (the burst's inputs) are in blocks 0..3: the table covers them all
    assert len(core.requests["a"].block_ids) == 4 and len(w.new_blocks) == 3
    assert max_result_bytes(512, 16, 6) > max_result_bytes(512, 16)


def test_a_sequence_aborted_while_its_burst_is_in_flight_takes_none_of_it():
    core, stage = make_core(num_steps=4), FakeStage()
    a = core.add("a", [10], SamplingParams(max_tokens=20))
    core.add("b", [11], SamplingParams(max_tokens=20))
    core.process_result(stage(core.next_schedule()))
    sched = core.next_schedule()
    assert sched.num_steps == 4
    core.abort("a")
    outs = core.process_result(stage(sched))
    assert [o.request_id for o in outs] == ["b"] and len(outs[0].token_ids) == 4
    assert len(a.output_ids) == 1 and a.block_ids == []


@pytest.mark.parametrize("bad", ["short", "order"])
def test_a_burst_result_without_every_token_in_order_is_refused_untouched(bad):
    core, stage = make_core(num_steps=3), FakeStage()
    core.add("a", [10], SamplingParams(max_tokens=20))
    core.add("b", [11], SamplingParams(max_tokens=20))
    core.process_result(stage(core.next_schedule()))
    sched = core.next_schedule()
    result = stage(sched)
    sampled = result.sampled[:-1] if bad == "short" else [result.sampled[1], result.sampled[0], *result.sampled[2:]]
    with pytest.raises(ValueError, match="3 tokens of each"):
        core.process_result(StepResult(sched.step_id, sampled))
    assert sched.step_id in core.in_flight and all(len(s.output_ids) == 1 for s in core.scheduler.running)
    assert len(core.process_result(result)) == 2


# -- the engine: bursts against single steps ----------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("multi-step-model")
    build_hf_model("mixtral", path)
    return path


PROMPTS = [[(5 * i + 7 * j) % 300 + 4 for j in range(2 + (3 * i) % 11)] for i in range(6)]


def engine(model_dir, num_steps, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineSettings(model=str(model_dir), block_size=4, num_scheduler_steps=num_steps, **kw),
                     progress=False)


def generate(eng: LLMEngine, params: list[SamplingParams]):
    seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    while eng.core.has_work():
        eng.step()
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [(s.output_ids, s.finish_reason, [(lp.token_id, round(lp.logprob, 4)) for lp in s.logprobs]) for s in seqs]


def count_native_bursts(eng: LLMEngine) -> list[int]:
    """Wraps the stage's native burst: the number of steps of each call."""
    fused, calls = eng.stages[0].runner.fused, []
    inner = fused.greedy

    def greedy(*args, **kw):
        calls.append(args[3])
        return inner(*args, **kw)

    fused.greedy = greedy
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_bursts_in_one_native_call_equal_single_steps(model_dir, dtype):
    params = [SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)] * len(PROMPTS)
    one = generate(engine(model_dir, 1, dtype=dtype), params)
    eng = engine(model_dir, 5, dtype=dtype)
    calls = count_native_bursts(eng)
    assert generate(eng, params) == one
    assert calls == [5, 5, 5]  # 16 tokens after the prefill's first: three bursts and a single step; six rows


def test_screened_bursts_hand_their_undecided_rows_to_the_full_head_together(model_dir, monkeypatch):
    """The lm_head's screen inside the native burst (kernels/cpu_gemm.py ScreenedHead), forced on
    whatever the CPU. Uneven final-norm weights give the rows different norms; with the screen's
    overflow guard set at their median, some rows of a step are decided by the screen and the others
    go to the full float32 head in one product, and with it below them all, every row does. The
    tokens are the full head's throughout."""
    from moemesh_kernels import cpu_gemm

    if cpu_gemm.native() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    params = [SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)] * len(PROMPTS)

    def run(screened: bool, cut: float | None = None):
        monkeypatch.setattr(cpu_gemm, "screen_product", lambda head, vocab, lib: [("native", 1)] if screened else [])
        eng = engine(model_dir, 5)
        model = eng.stages[0].runner.model
        model.model.norm.weight.data.copy_(torch.linspace(0.2, 3.0, model.config.hidden_size))  # (the burst's too)
        norms = []
        if screened:
            screen = model.lm_head.screen
            if cut is not None:
                screen.wn_max = 2.0 ** 126 / cut  # rows of norm cut or more fail the guard
            tokens = screen.tokens  # (the prefill's rows come through Python: their norms)
            screen.tokens = lambda x: norms.append(x.norm(dim=1)) or tokens(x)
        calls = count_native_bursts(eng)
        out = generate(eng, params)
        assert calls == [5, 5, 5]
        return out, torch.cat(norms) if norms else None

    full, _ = run(False)
    screened, seen = run(True)
    assert screened == full
    assert seen.max() > seen.min() * 1.01  # rows of different norms: a cut between them splits a step
    assert run(True, float(seen.median()))[0] == full
    assert run(True, float(seen.min()) / 2)[0] == full


@pytest.mark.parametrize("num_steps", [1, 5])
@pytest.mark.parametrize("batch", [1, 3, 6])
def test_a_bfloat16_heads_int8_screen_gives_the_full_heads_tokens(model_dir, monkeypatch, num_steps, batch):
    """A bfloat16 model's lm_head screened through its int8 copy (kernels/cpu_gemm.py ScreenedHead),
    step by step and in native bursts: the copy decides products of up to three rows (batch 1 and 3)
    and hands larger ones to the full head (batch 6); the tokens are the full head's throughout."""
    from moemesh_kernels import cpu_gemm

    if cpu_gemm.native() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * batch
    decided = []

    def run(screened: bool):
        monkeypatch.setattr(cpu_gemm, "screen_product",
                            lambda head, vocab, lib: [("int8", 1)] if screened and head.data.dtype == torch.bfloat16
                            else [])
        eng = engine(model_dir, num_steps, dtype="bfloat16")
        model = eng.stages[0].runner.model
        assert model.can_screen == screened
        if screened:
            assert model.lm_head.screen.copy.data.dtype == torch.int8 and model.lm_head.screen.max_rows == 3
            tokens = model.lm_head.screen.tokens
            model.lm_head.screen.tokens = lambda x: decided.append(len(x)) or tokens(x)
        seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS[:batch], params)]
        while eng.core.has_work():
            eng.step()
        return [s.output_ids for s in seqs]

    assert run(True) == run(False)
    if num_steps == 1:  # (a burst screens inside mm_greedy_decode, not through the Python call)
        assert decided and max(decided) == batch


@pytest.mark.parametrize("num_steps", [1, 5])
def test_a_bfloat16_heads_two_screens_give_the_full_heads_tokens(model_dir, monkeypatch, num_steps):
    """A bfloat16 model's lm_head with both its screens (cpu_gemm.HeadScreens): the int8 copy for up
    to three rows, torch's product of the head from four here (16 by default): six rows step by step
    go through torch's product (their rows rounded to bfloat16 as the full product rounds them), a
    native burst takes the full head; the tokens are the full head's throughout."""
    from moemesh_kernels import cpu_gemm

    if cpu_gemm.native() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 6
    decided = []

    def run(screened: bool):
        monkeypatch.setattr(cpu_gemm, "screen_product", lambda head, vocab, lib: [("int8", 1), ("onednn", 4)]
                            if screened and head.data.dtype == torch.bfloat16 else [])
        eng = engine(model_dir, num_steps, dtype="bfloat16")
        model = eng.stages[0].runner.model
        assert model.can_screen == screened
        if screened:
            wide = model.lm_head.screen.pick(6)
            assert wide.product == "onednn" and wide.copy_t.dtype == torch.bfloat16
            tokens = wide.tokens
            wide.tokens = lambda x: decided.append(len(x)) or tokens(x)
        seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS[:6], params)]
        while eng.core.has_work():
            eng.step()
        return [s.output_ids for s in seqs]

    assert run(True) == run(False)
    if num_steps == 1:  # (a burst takes the full head: torch's product cannot run inside it)
        assert decided and max(decided) == 6


def test_a_bfloat16_models_screened_tokens_are_its_rounded_logits_first_maximum(model_dir, monkeypatch):
    """A bfloat16 model's op-by-op head (a prompt's last row) rounds its logits to bfloat16: two that
    round to one value are tied there, where the screen's float32 logits are not. compute_tokens
    gives compute_logits' first maximum all the same."""
    from moemesh_kernels import cpu_gemm

    if cpu_gemm.native() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    monkeypatch.setattr(cpu_gemm, "screen_product",
                        lambda head, vocab, lib: [("int8", 1)] if head.data.dtype == torch.bfloat16 else [])
    model = engine(model_dir, 1, dtype="bfloat16").stages[0].runner.model
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    w = torch.randn(model.lm_head.vocab_size, H, generator=g).bfloat16()
    hidden = (w[:1].float() * 3 + 0.01 * torch.randn(24, H, generator=g)).bfloat16()
    normed = model._final_norm(hidden, None).float()
    # column 1: column 0 with one weight a bfloat16 step further along the rows (a float32 logit a
    # hair above column 0's, the same once rounded to bfloat16)
    j = int(normed[0].abs().argmax())
    up = 1 if (normed[0, j] > 0) == (w[0, j] > 0) else -1
    w[1] = w[0]
    w[1, j] = w[0, j].view(torch.int16).add(up).view(torch.bfloat16)
    model.lm_head.packed = cpu_gemm.pack(w.float(), cpu_gemm.native().panel_width, torch.bfloat16)
    model.lm_head.screen_packed()
    want = model.compute_logits(hidden, None).max(dim=-1).indices
    assert set(want.tolist()) <= {0, 1}
    screened = torch.cat([model.lm_head.screen.tokens(normed[i:i + 3]) for i in range(0, 24, 3)])
    assert (screened == 1).all() and (want == 0).any()  # (rows the float32 first maximum gets wrong)
    assert torch.equal(model.compute_tokens(hidden, None), want)


def test_a_stop_token_mid_burst_on_the_native_path_ends_the_row_there(model_dir):
    plain = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    greedy = generate(engine(model_dir, 1), [plain] * len(PROMPTS))
    stop = greedy[2][0][6]  # sampled by the second burst of 4 (tokens 5-8)
    params = [plain] * 2 + [SamplingParams(max_tokens=14, temperature=0, stop_token_ids=[stop], ignore_eos=True)] \
        + [plain] * 3
    one = generate(engine(model_dir, 1), params)
    eng = engine(model_dir, 4)
    calls = count_native_bursts(eng)
    assert generate(eng, params) == one
    assert calls and one[2][1] == "stop" and len(one[2][0]) == greedy[2][0].index(stop) + 1


def test_every_sampling_feature_in_bursts_equals_single_steps(model_dir):
    base = [SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)] * len(PROMPTS)
    greedy = generate(engine(model_dir, 1), base)
    stop = greedy[3][0][6]  # a token prompt 3 samples mid-burst: its stop token
    params = [
        SamplingParams(max_tokens=15, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0, stop_token_ids=[stop], ignore_eos=True),
        SamplingParams(max_tokens=15, temperature=0, repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0, min_tokens=9),
    ]
    one = generate(engine(model_dir, 1), params)
    eng = engine(model_dir, 4)
    calls = count_native_bursts(eng)
    assert generate(eng, params) == one
    assert calls == []  # not every row is plain greedy: the steps ran one by one, in the stage (gating: below)
    assert one[3][1] == "stop" and len(one[3][0]) == greedy[3][0].index(stop) + 1
    assert len(one[1][0]) == 15 and one[2][2] and len(one[2][2]) == 15


FEATURES = {  # a row the native burst cannot run: the rest of its batch greedy
    "temperature": dict(temperature=0.8, seed=3),
    "logprobs": dict(temperature=0, logprobs=1),
    "penalties": dict(temperature=0, repetition_penalty=1.5),
    "min_tokens": dict(temperature=0, min_tokens=12),  # (with a stop token, greedy's fourth: banned to the end)
}


@pytest.mark.parametrize("feature", FEATURES)
def test_one_row_the_native_burst_cannot_run_sends_its_batch_step_by_step(model_dir, feature):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    greedy = generate(engine(model_dir, 1), [plain] * len(PROMPTS))
    row = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[greedy[0][0][3]], **FEATURES[feature]) \
        if feature == "min_tokens" else SamplingParams(max_tokens=12, ignore_eos=True, **FEATURES[feature])
    params = [row] + [plain] * (len(PROMPTS) - 1)
    one = generate(engine(model_dir, 1), params)
    eng = engine(model_dir, 4)
    calls = count_native_bursts(eng)
    assert generate(eng, params) == one
    assert calls == []
    assert one[0][0] != greedy[0][0] or feature == "logprobs"  # (the feature changes what greedy would give)
    assert all(len(lps) == 12 for lps in [one[0][2]] if feature == "logprobs")


def test_the_op_by_op_path_runs_bursts_too(model_dir):
    params = [SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)] * len(PROMPTS)
    one = generate(engine(model_dir, 1, moe_backend="torch"), params)
    eng = engine(model_dir, 3, moe_backend="torch")
    assert eng.stages[0].runner.fused is None
    assert generate(eng, params) == one == generate(engine(model_dir, 1), params)


def test_requests_joining_between_bursts_get_what_they_would_alone(model_dir):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in engine(model_dir, 1).generate(PROMPTS, params)]
    eng = engine(model_dir, 4)
    seqs = []
    for p in PROMPTS:  # one more request after every step
        seqs.append(eng.add_request(p, params))
        eng.step()
    while eng.core.has_work():
        eng.step()
    assert [s.output_ids for s in seqs] == alone


def test_the_native_burst_checks_its_indices_first(model_dir):
    eng = engine(model_dir, 4, num_kv_blocks=8)
    runner = eng.stages[0].runner
    fused, limits = runner.fused, (8, eng.model_config.max_position_embeddings)
    with pytest.raises(ValueError, match="outside the embedding"):
        fused.greedy([eng.model_config.vocab_size], [0], [[0]], 2, 4, limits)
    with pytest.raises(ValueError, match="outside the cache or the rotary"):  # the burst's last position is 10
        fused.greedy([5], [8], [list(range(8))], 3, 4, (8, 10))
    assert len(fused.greedy([5], [7], [list(range(8))], 3, 4, (8, 10))) == 3
    with pytest.raises(IndexError):  # the table covers positions 0..3, the burst reaches 4
        fused.greedy([5], [2], [[1]], 3, 4, limits)
    with pytest.raises(ValueError, match="outside the"):
        fused.greedy([5], [0], [[8]], 2, 4, limits)
    with pytest.raises(ValueError, match="outside the cache or the rotary"):  # the last step's position is 1
        fused.greedy([5], [-6], [[3, 4]], 8, 4, limits)
    assert fused.greedy([5], [0], [[1]], 4, 4, limits)[3]  # the table's last slot is fine
    # a schedule from the wire that starts a sequence before position 0 never reaches the kernels
    last = eng.stages[0]
    last.run(Schedule(0, [SeqWork(0, [9] * 7, 0, [0, 1], True, SamplingParams(max_tokens=9, temperature=0), 1)]))
    with pytest.raises(ValueError, match="starts at -6, outside the 7"):
        last.run(Schedule(1, [SeqWork(0, [9], -6, [], True)], num_steps=8))


def test_bursts_need_one_stage_of_one_rank(model_dir):
    with pytest.raises(ConfigError, match=r"--num-scheduler-steps 4 needs .*\(--pp 1 --tp 1\), not --pp 2"):
        engine(model_dir, 4, layer_partition=(2, 2))
    with pytest.raises(ConfigError, match="--num-scheduler-steps 4 runs one microbatch .* --max-in-flight 2"):
        engine(model_dir, 4, max_in_flight=2)
    split = engine(model_dir, 1, layer_partition=(2, 2))
    last = split.stages[-1]
    sched = Schedule(0, [SeqWork(0, [5], 0, [0], True, SamplingParams(max_tokens=4), 1)], num_steps=2)
    with pytest.raises(ValueError, match="whole model"):
        last.run(sched, torch.zeros(1, split.model_config.hidden_size))
