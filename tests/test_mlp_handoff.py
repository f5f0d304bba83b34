"""The MLP hand-off: a stage also holds the previous stage's last MLP, and each step's tokens are split
between the two; greedy output stays the same whatever the split, and the coordinator's split evens
the stages' modelled times."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hf_models import build_hf_model
from moemesh.config import ModelConfig, RopeConfig
from moemesh.entrypoints.engine import LLMEngine
from moemesh.layout import Layout, StageCosts, balanced_partition, handoff_partition, resolve_layout, split, \
    stage_costs
from moemesh.protocol import Schedule, SeqWork
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings, partition_arg
from coordinator.balance import HandoffBalancer

PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 250, 251, 3, 4, 77, 78, 79],
           list(range(30, 70)), [299, 1, 298, 2]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


class RandomSplit:
    """A balancer that splits each boundary of each step in turn at a random number of the step's
    tokens, at none of them and at all of them (the first step: at a random number)."""

    def __init__(self, pp: int, seed: int = 0):
        self.rng, self.pp = random.Random(seed), pp
        self.turn = itertools.count()
        self.seen: set[str] = set()

    def assign(self, sched: Schedule) -> list[int]:
        tokens = sum(len(w.token_ids) for w in sched.seqs)
        rows = [[self.rng.randint(1, max(1, tokens - 1)), 0, tokens][next(self.turn) % 3] for _ in range(self.pp - 1)]
        decode = tokens == len(sched.seqs)
        self.seen.update(f"{'decode' if decode else 'prefill'}:{'none' if r == 0 else 'all' if r == tokens else 'some'}"
                         for r in rows)
        return rows

    def observe(self, step_id, stage_seconds):
        assert len(stage_seconds) == self.pp and all(s > 0 for s in stage_seconds)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "llama"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"handoff-{request.param}")
    build_hf_model(request.param, path)
    whole = LLMEngine(EngineSettings(model=str(path), num_kv_blocks=64), progress=False)
    return path, [o.token_ids for o in whole.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("stages,budget", [((2, 2), 512), ((2, 2), 7), ((1, 1, 2), 512)],
                         ids=["2+2", "2+2-chunked", "1+1+2"])
def test_greedy_output_is_the_same_whatever_the_split(checkpoint, stages, budget):
    """Every step split at random (the fused decode path and the op-by-op one, prompt chunks and
    decodes, a middle stage that receives and hands on), against the model run whole."""
    path, reference = checkpoint
    engine = LLMEngine(EngineSettings(model=str(path), num_kv_blocks=64, layer_partition=stages, mlp_handoff=True,
                                      max_batched_tokens=budget), progress=False)
    assert isinstance(engine.loop.balancer, HandoffBalancer)  # the real one: its own choices first
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    engine.loop.balancer = RandomSplit(len(stages))
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert {"prefill:some", "decode:some", "decode:none", "decode:all"} <= engine.loop.balancer.seen
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_stage_loads_the_previous_layers_mlp_and_nothing_else_of_it(tmp_path):
    build_hf_model("mixtral", tmp_path)
    engine = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=16, layer_partition=(2, 2),
                                      mlp_handoff=True), progress=False)
    first, second = (s.runner for s in engine.stages)
    read = second.load_stats.tensors_read
    assert "model.layers.1.post_attention_layernorm.weight" in read
    assert any(n.startswith("model.layers.1.block_sparse_moe.experts.") for n in read)
    assert not any(n.startswith("model.layers.1.self_attn") or n.startswith("model.layers.0.") for n in read)
    assert second.model.handoff_layer == 1 and first.model.handoff_layer is None
    assert second.kv_cache.shape[0] == 2  # K/V for its own two layers only: the hand-off keeps no state
    # the hand-off MLP is layer 1's MLP, weight for weight
    held, own = second.model.model.handoff["1"], first.model.model.layers["1"]
    for a, b in [(held.post_attention_layernorm.weight, own.post_attention_layernorm.weight),
                 *zip((p.data for p in held.mlp.experts.packed), (p.data for p in own.mlp.experts.packed))]:
        assert torch.equal(a, b)


def test_tokens_handed_to_a_stage_without_the_mlp_are_refused(tmp_path):
    from stage_worker.runner import StepInput

    build_hf_model("llama", tmp_path)
    engine = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=16, layer_partition=(2, 2)), progress=False)
    runner = engine.stages[1].runner
    step = StepInput([[5, 6, 7]], [0], [[0]], [True])
    stream = torch.randn(3, runner.config.hidden_size)
    with pytest.raises(ValueError, match="does not hold"):
        runner.execute(step, stream, rows_in=1)
    with pytest.raises(ValueError, match="rows_in 4 is outside 0..3"):
        runner.execute(step, stream, rows_in=4)
    with pytest.raises(ValueError, match="the last stage hands no MLP on"):
        runner.execute(step, stream, rows_out=3)
    sched = Schedule(0, [SeqWork(0, [5, 6, 7], 0, [0], True, SamplingParams(temperature=0), 3)], mlp_rows=[3, 3])
    with pytest.raises(ValueError, match="2 MLP hand-off entries, stage 3 needs 3"):
        type(engine.stages[1])(runner, pp_rank=3)._handoff(sched)


def bench_config(layers=8):
    return ModelConfig(model_type="mixtral", vocab_size=32000, hidden_size=512, num_layers=layers, num_heads=8,
                       num_kv_heads=2, head_dim=64, intermediate_size=1024, rms_norm_eps=1e-5, rope=RopeConfig(),
                       max_position_embeddings=64, num_experts=8, top_k=2, moe_intermediate_size=1024)


def test_the_split_evens_two_stages_within_what_one_mlp_can_move():
    costs = [StageCosts(fixed=10.0, mlp_out=4.0), StageCosts(fixed=6.0, mlp_in=4.0, head=8.0)]
    # a decode step of 64: 10 T + 4 r = 6 T + 4 (T - r) + 8 T -> r = 1.0 T ... clamped to T
    rows, worst = split(costs, [1.0, 1.0], 64, 64)
    assert rows == [64] and worst == pytest.approx(max(14 * 64, 14 * 64))
    # prompt tokens (no head): 10 T + 4 r = 10 T - 4 r -> r = 0
    assert split(costs, [1.0, 1.0], 64, 0)[0] == [0]
    # half the rows sampled: 10 T + 4 r = 10 T - 4 r + 8 T / 2 -> r = T / 2
    assert split(costs, [1.0, 1.0], 64, 32)[0] == [32]
    # a measured speed per stage moves it: stage 0 twice as slow per unit
    rows, worst = split(costs, [2.0, 1.0], 64, 64)
    assert rows == [0] and worst == pytest.approx(2 * 10 * 64)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_no_other_split_of_a_step_has_a_faster_slowest_stage(pp):
    model = bench_config()
    layout = Layout(balanced_partition(model, pp, 0.5), mlp_handoff=True)
    costs = stage_costs(model, layout)
    rng = random.Random(pp)
    for _ in range(5):
        scales = [rng.uniform(0.5, 2.0) for _ in range(pp)]
        tokens = 16
        logit_rows = rng.randint(0, tokens)
        _, worst = split(costs, scales, tokens, logit_rows)
        best = min(max(s * c.time(tokens, logit_rows if i == pp - 1 else 0, ins, outs)
                       for i, (c, s, ins, outs) in enumerate(zip(costs, scales, (tokens, *rows), (*rows, 0))))
                   for rows in itertools.product(range(tokens + 1), repeat=pp - 1))
        assert worst <= best * (1 + 1e-6) + costs[0].mlp_out * max(scales)  # within one token's MLP (rounding)


def test_the_balancer_learns_each_stages_speed_for_decodes_and_prompts_apart():
    model = bench_config()
    balancer = HandoffBalancer.for_layout(model, Layout((6, 2), mlp_handoff=True))
    assert HandoffBalancer.for_layout(model, Layout((6, 2))) is None
    decode = Schedule(0, [SeqWork(i, [1], 5, [], True) for i in range(64)])
    before = balancer.assign(decode)[0]
    assert before == 64  # as modelled, stage 0 runs the whole MLP and is still the less busy
    # stage 0 turns out 1.2 times as slow per unit of work on decodes: it hands about half the MLP over
    c0, c1 = balancer.costs
    unit = 4e-11  # seconds per modelled multiply-add, about this machine's
    balancer.observe(0, [1.2 * unit * c0.time(64, 0, 64, before), unit * c1.time(64, 64, before, 0)])
    after = balancer.assign(Schedule(1, decode.seqs))[0]
    assert 0 < after < before
    t0, t1 = 1.2 * c0.time(64, 0, 64, after), c1.time(64, 64, after, 0)
    assert abs(t0 - t1) <= 2 * c0.mlp_out  # even, within a token's MLP either way
    assert balancer.scales[False] == [1.0, 1.0]  # prompt steps have their own, not learnt yet
    balancer.observe(7, [1.0, 1.0])  # a step never assigned (or dropped by a reset): ignored
    balancer.observe(1, [1.0])  # a result without every stage's time: ignored
    assert not balancer.pending


@pytest.mark.parametrize("bad", [5e-324, 0.0, -1.0, float("inf"), float("nan"), 1e300])
def test_a_stage_time_no_stage_can_take_teaches_the_balancer_nothing(bad):
    """A peer's bogus time (or an empty step's) must neither crash the coordinator nor skew the split."""
    model = bench_config()
    balancer = HandoffBalancer.for_layout(model, Layout((6, 2), mlp_handoff=True))
    decode = [SeqWork(i, [1], 5, [], True) for i in range(64)]
    first = balancer.assign(Schedule(0, decode))
    balancer.observe(0, [0.05, bad])
    balancer.observe(1, [bad, 0.05])
    assert balancer.scales[True] == [1.0, 1.0] and not balancer.learnt[True]
    assert balancer.assign(Schedule(2, decode)) == first
    # and a split with scales that are not positive and finite treats them as 1
    costs = balancer.costs
    assert split(costs, [0.0, float("nan")], 64, 64) == split(costs, [1.0, 1.0], 64, 64)


def test_auto_with_the_handoff_picks_the_split_its_balance_serves_best():
    model = bench_config()
    ones = [1.0, 1.0]

    def cost(counts, share):
        costs = stage_costs(model, Layout(counts, mlp_handoff=True))
        return (1 - share) * split(costs, ones, 64, 0)[1] + share * split(costs, ones, 64, 64)[1]

    for share in (0.0, 64 / 96, 1.0):
        got = handoff_partition(model, 2, share)
        assert cost(got, share) == min(cost((a, 8 - a), share) for a in range(1, 8))
    layout = resolve_layout(model, 2, partition=partition_arg("auto:32:64"), mlp_handoff=True)
    assert layout.mlp_handoff and layout.stage_layers == handoff_partition(model, 2, 64 / 96)
    assert not resolve_layout(model, 1, mlp_handoff=True).mlp_handoff  # one stage: nothing to hand off


def test_generate_resolves_auto_with_the_handoff_as_the_coordinator_does(tmp_path):
    import argparse

    from moemesh.entrypoints.generate import engine_settings_from_args
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

    # the bench model's shape in miniature: a head worth several layers
    write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=8, hidden_size=64, intermediate_size=128, num_experts=8,
                                   vocab_size=4000), tmp_path)
    model = ModelConfig.from_dir(tmp_path)
    parser = argparse.ArgumentParser()
    EngineSettings.add_arguments(parser, environ={})
    got = {}
    for handoff in (False, True):
        argv = ["--model", str(tmp_path), "--pp", "2", "--layer-partition", "auto:32:64"] + \
            (["--mlp-handoff"] if handoff else [])
        got[handoff] = engine_settings_from_args(parser.parse_args(argv)).layer_partition
    assert got == {False: balanced_partition(model, 2, 64 / 96), True: handoff_partition(model, 2, 64 / 96)}
    assert got[False] != got[True]
