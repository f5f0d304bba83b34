"""The MLP hand-off: a stage after the first also holds the previous stage's last MLP, and a step
the coordinator hands off runs that MLP there (moemesh.layout.MlpHandoff chooses; models/base.py,
runner.py and executor.py compute it). Whatever is handed off, greedy tokens are the whole model's."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from moemesh.config import ModelConfig, RopeConfig
from moemesh.entrypoints.engine import LLMEngine
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
from moemesh.layout import MlpHandoff, decode_costs, mlp_costs
from moemesh.protocol import Schedule, SeqWork
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings

PROMPTS = [[(20 + 7 * i + 3 * j) % 380 + 2 for j in range(3 + 5 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def bench_config(layers=8, mlp_only=()):
    """The benchmark model's shape (docs/benchmarks.md): 8 layers of 3.8M multiply-adds per token, a
    head of 16.4M."""
    return ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=512, num_layers=layers, num_heads=8,
                       num_kv_heads=2, head_dim=64, intermediate_size=1024, rms_norm_eps=1e-5, rope=RopeConfig(),
                       max_position_embeddings=64, num_experts=8, top_k=2, moe_intermediate_size=1024,
                       mlp_only_layers=tuple(mlp_only))


def stage_costs(model, stages, query_lens, head_rows, handed):
    """Each stage's cost of a step (decode_costs' unit), with the MLPs of `handed` run by the next stage."""
    layers, head = decode_costs(model)
    mlps, tokens = mlp_costs(model), sum(query_lens)
    costs = [tokens * sum(layers[i] for i in r) for r in stages]
    costs[-1] += head * head_rows
    for s, r in enumerate(stages[:-1]):
        if r.stop - 1 in handed:
            costs[s] -= tokens * mlps[r.stop - 1]
            costs[s + 1] += tokens * mlps[r.stop - 1]
    return costs


# -- the choice -----------------------------------------------------------------------------------

def test_the_benchmark_split_hands_prompt_chunks_off_and_never_decodes():
    handoff = MlpHandoff(bench_config(), [range(0, 5), range(5, 8)])
    choose = handoff.choose
    assert choose([32] * 16, 16) == [4]  # a prompt chunk: five layers against three (and 16 heads)
    assert choose([1] * 64, 64) == []  # decodes alone run in one native call: never
    assert choose([1] * 93 + [32] * 2, 95) == []  # mostly decodes: the last stage's heads outweigh
    assert choose([32] * 16, 16 + 512) == []  # prompt logprobs: every row through the head
    assert choose([1] * 7 + [2], 8) == []
    assert handoff.layers == {4} and handoff.holds(range(5, 8)) and not handoff.holds(range(0, 5))


def test_only_a_split_heavier_in_front_holds_an_mlp_twice():
    """Equal layers split evenly never hand off (the last stage also carries the head): no stage
    holds a copy. The other way round, the later stage the heavier, neither."""
    model = bench_config()
    assert MlpHandoff.for_layout(model, [range(0, 4), range(4, 8)]) is None
    assert MlpHandoff.for_layout(model, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]) is None
    assert MlpHandoff.for_layout(model, [range(0, 3), range(3, 8)]) is None
    assert MlpHandoff.for_layout(model, [range(0, 8)]) is None
    stages = [range(0, 4), range(4, 7), range(7, 8)]  # the middle stage takes one MLP and gives one
    three = MlpHandoff.for_layout(model, stages)
    assert three.layers == {3, 6} and [three.holds(r) for r in stages] == [False, True, True]
    stages = [range(0, 4), range(4, 6), range(6, 8)]  # (handing layer 5's on would even nothing)
    assert MlpHandoff.for_layout(model, stages).layers == {3}


@pytest.mark.parametrize("layers,split,mlp_only", [(8, (5, 3), ()), (9, (4, 3, 2), (3,)), (7, (3, 2, 1, 1), ())])
def test_each_boundary_is_handed_off_exactly_where_that_lowers_its_busier_stage(layers, split, mlp_only):
    model = bench_config(layers, mlp_only)
    starts = list(itertools.accumulate(split, initial=0))
    stages = [range(a, b) for a, b in zip(starts, starts[1:])]
    handoff = MlpHandoff(model, stages)
    rng = random.Random(0)
    for _ in range(200):
        query_lens = [rng.choice([1, 1, 1, rng.randint(2, 64)]) for _ in range(rng.randint(1, 40))]
        head_rows = rng.randint(0, len(query_lens))
        got = handoff.choose(query_lens, head_rows)
        assert set(got) <= handoff.layers  # (what the stages hold)
        if all(q == 1 for q in query_lens):
            assert got == []
            continue
        handed: list[int] = []
        for s, r in enumerate(stages[:-1]):  # the same rule, from the costs written out here
            before = stage_costs(model, stages, query_lens, head_rows, handed)
            after = stage_costs(model, stages, query_lens, head_rows, handed + [r.stop - 1])
            if max(after[s], after[s + 1]) < max(before[s], before[s + 1]):
                handed.append(r.stop - 1)
        assert got == handed
        assert max(stage_costs(model, stages, query_lens, head_rows, got)) <= \
            max(stage_costs(model, stages, query_lens, head_rows, []))


def test_a_single_stage_has_nothing_to_hand_off():
    with pytest.raises(ValueError, match="two stages"):
        MlpHandoff(bench_config(), [range(0, 8)])


# -- the tokens ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Four layers of each architecture; the Qwen2-MoE model's layer 2 (the one (3, 1) hands over)
    has a dense MLP."""
    root = tmp_path_factory.mktemp("handoff")
    specs = {arch: TinyModelSpec(arch=arch, num_layers=4, vocab_size=384) for arch in ("mixtral", "qwen3_moe", "llama")}
    specs["qwen2_moe"] = TinyModelSpec(arch="qwen2_moe", num_layers=4, vocab_size=384, mlp_only_layers=(2,))
    return {arch: write_tiny_model(spec, root / arch) for arch, spec in specs.items()}


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineSettings(model=str(model), num_kv_blocks=64, max_batched_tokens=16, **kw), progress=False)


class _Watch:
    """What an in-process pipeline was asked and did: each schedule's hand-off, the stages' spans,
    and how many rows each stage's hand-off MLP ran."""

    def __init__(self, engine: LLMEngine):
        self.sent: list[tuple[int, ...]] = []
        self.tokens_handed = 0  # of the steps that hand something over
        send = engine.pipeline.send
        engine.pipeline.send = lambda s: (self._sent(s), send(s))[1]
        self.rows = [0] * len(engine.pipeline.stages)
        for i, stage in enumerate(engine.pipeline.stages):
            for mlp in getattr(stage.runner.model.model, "handoff", {}).values():
                mlp.register_forward_hook(lambda m, args, out, i=i: self._ran(i, args[0]))
        self.stages = engine.pipeline.stages

    def _sent(self, sched) -> None:
        self.sent.append(tuple(sched.mlp_handoff))
        self.tokens_handed += sum(len(w.token_ids) for w in sched.seqs) if sched.mlp_handoff else 0

    def _ran(self, stage: int, stream) -> None:
        self.rows[stage] += stream.shape[0]

    def spans(self, stage: int) -> list[list[int]]:
        return [s.mlp_handoff for s in self.stages[stage].spans]


def _force(engine: LLMEngine, decodes: bool) -> _Watch:
    """Every boundary handed off at every step with a prompt token (and, with `decodes`, at every
    step)."""
    every = [r.stop - 1 for r in engine.layout.stages[:-1]]
    engine.core.handoff.choose = lambda q, rows: every if decodes or any(n > 1 for n in q) else []
    return _Watch(engine)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "llama"])
@pytest.mark.parametrize("partition", [(3, 1), (2, 1, 1)])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_tokens_are_the_whole_models_whatever_is_handed_off(models, arch, partition, backend, monkeypatch):
    """float32: a hand-off moves where the MLP runs, not a value it computes. On the native kernels
    a decode handed off leaves the one-call path on the stage that stops before the MLP; the stage
    that runs it goes on with its one call (from a residual stream and a residual). Every stage
    after the first holds the MLP before its own here, so that (2, 1, 1)'s middle stage both takes
    one and gives one."""
    whole = [o.token_ids for o in _engine(models[arch], moe_backend=backend).generate(PROMPTS, GREEDY)]
    monkeypatch.setattr(MlpHandoff, "holds", lambda self, stage: stage.start > 0)
    for decodes in (False, True):
        engine = _engine(models[arch], layer_partition=partition, moe_backend=backend)
        watch = _force(engine, decodes)
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == whole
        every = tuple(r.stop - 1 for r in engine.layout.stages[:-1])
        assert every in watch.sent and (() in watch.sent) != decodes
        handed = sum(t == every for t in watch.sent)
        # each stage took part in every step handed off, and the stages after the first ran the MLP
        for i, r in enumerate(engine.layout.stages):
            mine = [x for x in (r.start - 1, r.stop - 1) if x in every]
            assert watch.spans(i).count(mine) == handed
            assert watch.rows[i] == (watch.tokens_handed if i > 0 else 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_chunks_handed_off_give_the_same_logprobs_to_the_bit(models, dtype):
    """A prompt chunk's stream crosses a stage boundary rounded to the model's dtype once, wherever
    the boundary lies: handing the MLP over changes no value. Decodes, which the coordinator never
    hands off, keep their one native call."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    kw = dict(dtype=dtype, layer_partition=(3, 1))
    plain = _engine(models["mixtral"], no_mlp_handoff=True, **kw)
    assert plain.core.handoff is None and not hasattr(plain.pipeline.stages[1].runner.model.model, "handoff")
    handed = _engine(models["mixtral"], **kw)
    watch = _force(handed, decodes=False)
    logits = {}
    for name, engine in (("plain", plain), ("handed", handed)):
        runner, logits[name] = engine.pipeline.stages[-1].runner, []
        execute = runner.execute
        runner.execute = lambda *a, _f=execute, _out=logits[name], **k: (r := _f(*a, **k), _out.append(r.clone()))[0]
        assert [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert len(logits["handed"]) == len(logits["plain"]) > 0
    assert all(torch.equal(a, b) for a, b in zip(logits["handed"], logits["plain"]))
    assert (2,) in watch.sent and watch.rows[1] == watch.tokens_handed >= sum(map(len, PROMPTS))


def test_the_engine_hands_off_on_its_own_and_counts_it(models):
    engine = _engine(models["mixtral"], layer_partition=(3, 1))
    watch = _Watch(engine)
    whole = _engine(models["mixtral"]).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o.token_ids for o in whole]
    assert engine.core.handoff_steps == watch.sent.count((2,)) > 0 and set(watch.sent) == {(), (2,)}
    assert watch.spans(1).count([2]) == engine.core.handoff_steps


def test_the_engine_counts_prompt_logprob_rows_as_the_last_stage_does(models):
    """The cost the coordinator weighs a step by takes the rows the last stage computes logits of:
    each sampled row, and the prompt positions of a chunk whose prompt logprobs are wanted."""
    engine = _engine(models["mixtral"], layer_partition=(3, 1))
    asked, choose = [], engine.core.handoff.choose
    engine.core.handoff.choose = lambda q, rows: (asked.append((list(q), rows)), choose(q, rows))[1]
    prompt = list(range(40, 60))  # 20 tokens: chunks of 16 and 4
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1))
    # the first chunk: positions 0-15 predict tokens 1-16; the second: 16-18 (19 predicts no prompt
    # token) and it samples; the decode after it samples one row
    assert asked == [([16], 16), ([4], 4), ([1], 1)]


def test_an_even_split_holds_no_second_mlp(models):
    engine = _engine(models["mixtral"], layer_partition=(2, 2))
    assert engine.core.handoff is None
    assert not any(hasattr(s.runner.model.model, "handoff") for s in engine.pipeline.stages)


def test_a_stage_without_the_mlp_refuses_a_step_that_hands_it_over(models):
    engine = _engine(models["mixtral"], layer_partition=(3, 1), no_mlp_handoff=True)
    last = engine.pipeline.stages[-1]
    work = [SeqWork(0, [5, 6, 7], 0, [0], True, params=GREEDY, prompt_len=3)]
    stream = engine.pipeline.stages[0].run(Schedule(0, work, mlp_handoff=[2]))
    with pytest.raises(ValueError, match="MLP of layer 2, which this stage does not hold"):
        last.run(Schedule(0, work, mlp_handoff=[2]), stream)
