"""The MLP hand-off: a stage after the first also holds the previous stage's last MLP, and a step
the coordinator hands off runs that MLP there (moemesh.layout.MlpHandoff chooses; models/base.py,
runner.py and executor.py compute it). Whatever is handed off, greedy tokens are the whole model's."""

from __future__ import annotations

import itertools
import random

import pytest

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


def stage_costs(model, stages, query_lens, sampled, handed):
    """Each stage's cost of a step (decode_costs' unit), with the MLPs of `handed` run by the next stage."""
    layers, head = decode_costs(model)
    mlps, tokens = mlp_costs(model), sum(query_lens)
    costs = [tokens * sum(layers[i] for i in r) for r in stages]
    costs[-1] += head * sampled
    for s, r in enumerate(stages[:-1]):
        if r.stop - 1 in handed:
            costs[s] -= tokens * mlps[r.stop - 1]
            costs[s + 1] += tokens * mlps[r.stop - 1]
    return costs


# -- the choice -----------------------------------------------------------------------------------

def test_the_benchmark_split_hands_prompt_chunks_off_and_never_decodes():
    choose = MlpHandoff(bench_config(), [range(0, 5), range(5, 8)]).choose
    assert choose([32] * 16, 16) == [4]  # a prompt chunk: five layers against three (and 16 heads)
    assert choose([1] * 64, 64) == []  # decodes alone run in one native call: never
    assert choose([1] * 93 + [32] * 2, 95) == []  # mostly decodes: the last stage's heads outweigh
    assert choose([1] * 7 + [2], 8) == []
    # the other way round the later stage is the heavier: moving an MLP there would make it worse
    assert MlpHandoff(bench_config(), [range(0, 3), range(3, 8)]).choose([32] * 16, 16) == []


@pytest.mark.parametrize("layers,split,mlp_only", [(8, (5, 3), ()), (9, (4, 3, 2), (3,)), (7, (3, 2, 1, 1), ())])
def test_each_boundary_is_handed_off_exactly_where_that_lowers_its_busier_stage(layers, split, mlp_only):
    model = bench_config(layers, mlp_only)
    starts = list(itertools.accumulate(split, initial=0))
    stages = [range(a, b) for a, b in zip(starts, starts[1:])]
    choose = MlpHandoff(model, stages).choose
    rng = random.Random(0)
    for _ in range(200):
        query_lens = [rng.choice([1, 1, 1, rng.randint(2, 64)]) for _ in range(rng.randint(1, 40))]
        sampled = rng.randint(0, len(query_lens))
        got = choose(query_lens, sampled)
        if all(q == 1 for q in query_lens):
            assert got == []
            continue
        handed: list[int] = []
        for s, r in enumerate(stages[:-1]):  # the same rule, from the costs written out here
            before = stage_costs(model, stages, query_lens, sampled, handed)
            after = stage_costs(model, stages, query_lens, sampled, handed + [r.stop - 1])
            if max(after[s], after[s + 1]) < max(before[s], before[s + 1]):
                handed.append(r.stop - 1)
        assert got == handed
        assert max(stage_costs(model, stages, query_lens, sampled, got)) <= \
            max(stage_costs(model, stages, query_lens, sampled, []))


def test_a_single_stage_has_nothing_to_hand_off():
    with pytest.raises(ValueError, match="two stages"):
        MlpHandoff(bench_config(), [range(0, 8)])


# -- the tokens ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("handoff")
    return {arch: write_tiny_model(TinyModelSpec(arch=arch, num_layers=4, vocab_size=384), root / arch)
            for arch in ("mixtral", "qwen2_moe", "qwen3_moe", "llama")}


def _engine(model, **kw) -> LLMEngine:
    return LLMEngine(EngineSettings(model=str(model), num_kv_blocks=64, max_batched_tokens=16, **kw), progress=False)


def _force(engine: LLMEngine, decodes: bool) -> list[tuple[int, ...]]:
    """Every boundary handed off at every step with a prompt token (and, with `decodes`, at every
    step): -> each schedule's hand-off, as the engine sends them."""
    every = [r.stop - 1 for r in engine.layout.stages[:-1]]
    engine.core.handoff.choose = lambda q, s: every if decodes or any(n > 1 for n in q) else []
    seen, send = [], engine.pipeline.send
    engine.pipeline.send = lambda s: (seen.append(tuple(s.mlp_handoff)), send(s))[1]
    return seen


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "llama"])
@pytest.mark.parametrize("partition", [(3, 1), (1, 2, 1)])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_tokens_are_the_whole_models_whatever_is_handed_off(models, arch, partition, backend):
    """float32: a hand-off moves where the MLP runs, not a value it computes; on the native kernels a
    handed-off decode leaves the one-call path for the op-by-op one, which computes the same."""
    whole = [o.token_ids for o in _engine(models[arch], moe_backend=backend).generate(PROMPTS, GREEDY)]
    for decodes in (False, True):
        engine = _engine(models[arch], layer_partition=partition, moe_backend=backend)
        seen = _force(engine, decodes)
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == whole
        every = tuple(r.stop - 1 for r in engine.layout.stages[:-1])
        assert every in seen and (() in seen) != decodes


def test_bfloat16_prompt_chunks_handed_off_give_the_same_tokens(models):
    """In bfloat16 a stage boundary rounds the residual stream once, wherever it lies; decodes, which
    the coordinator never hands off, keep their one native call."""
    kw = dict(dtype="bfloat16", layer_partition=(3, 1))
    plain = _engine(models["mixtral"], no_mlp_handoff=True, **kw)
    assert plain.core.handoff is None
    handed = _engine(models["mixtral"], **kw)
    seen = _force(handed, decodes=False)
    assert [o.token_ids for o in handed.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert (2,) in seen


def test_the_engine_hands_off_on_its_own_and_counts_it(models):
    engine = _engine(models["mixtral"], layer_partition=(3, 1))
    seen = []
    send = engine.pipeline.send
    engine.pipeline.send = lambda s: (seen.append(tuple(s.mlp_handoff)), send(s))[1]
    whole = _engine(models["mixtral"]).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o.token_ids for o in whole]
    assert engine.core.handoff_steps == seen.count((2,)) > 0 and set(seen) == {(), (2,)}


def test_a_stage_without_the_mlp_refuses_a_step_that_hands_it_over(models):
    engine = _engine(models["mixtral"], layer_partition=(3, 1), no_mlp_handoff=True)
    last = engine.pipeline.stages[-1]
    stream = engine.pipeline.stages[0].run(Schedule(0, [SeqWork(0, [5, 6, 7], 0, [0], True, params=GREEDY,
                                                                prompt_len=3)], mlp_handoff=[2]))
    with pytest.raises(ValueError, match="MLP of layer 2, which this stage does not hold"):
        last.run(Schedule(0, [SeqWork(0, [5, 6, 7], 0, [0], True, params=GREEDY, prompt_len=3)], mlp_handoff=[2]),
                 stream)
