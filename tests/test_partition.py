"""`--layer-partition auto`: stages balanced by their cost per token, the last one carrying the head
(paid by sampled tokens only)."""

from __future__ import annotations

import itertools

import pytest

from moemesh.entrypoints.cli import main
from moemesh.config import ConfigError, ModelConfig, RopeConfig
from moemesh.layout import balanced_partition, decode_costs


def config(layers=8, vocab=32000, hidden=512, mlp_only=()):
    return ModelConfig(model_type="mixtral", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=8,
                       num_kv_heads=2, head_dim=64, intermediate_size=1024, rms_norm_eps=1e-5, rope=RopeConfig(),
                       max_position_embeddings=64, num_experts=8, top_k=2, moe_intermediate_size=1024,
                       mlp_only_layers=tuple(mlp_only))


def worst_stage(model, counts, sampled_share=1.0):
    layers, head = decode_costs(model)
    head *= sampled_share
    out, start = [], 0
    for i, n in enumerate(counts):
        out.append(sum(layers[start:start + n]) + (head if i == len(counts) - 1 else 0))
        start += n
    return max(out)


def test_the_benchmark_model_gives_the_last_stage_fewer_layers():
    # 8 equal layers of ~3.8M multiply-adds per decode token; the head (32000 x 512) is ~4.3 layers
    assert balanced_partition(config(), 1) == (8,)
    assert balanced_partition(config(), 2) == (6, 2)
    assert balanced_partition(config(), 8) == (1,) * 8
    with pytest.raises(ConfigError, match="--pp 9"):
        balanced_partition(config(), 9)


def test_prefill_moves_layers_back_to_the_last_stage():
    """Prompt tokens skip the head: the more of them, the more layers the last stage takes."""
    assert balanced_partition(config(), 2, 64 / 96) == (5, 3)  # 32-token prompts, 64 generated
    assert balanced_partition(config(), 2, 0.2) == (4, 4)  # long prompts, short answers
    assert balanced_partition(config(), 2, 0.0) == (4, 4)


@pytest.mark.parametrize("share", [1.0, 0.5])
@pytest.mark.parametrize("layers,pp,vocab,mlp_only", [(7, 3, 4000, ()), (9, 4, 20000, (1, 2)), (6, 2, 500, (0,))])
def test_no_other_split_has_a_cheaper_busiest_stage(layers, pp, vocab, mlp_only, share):
    model = config(layers, vocab, mlp_only=mlp_only)
    got = balanced_partition(model, pp, share)
    assert sum(got) == layers and min(got) >= 1 and len(got) == pp
    splits = [c for c in itertools.product(range(1, layers + 1), repeat=pp) if sum(c) == layers]
    assert worst_stage(model, got, share) == min(worst_stage(model, c, share) for c in splits)


def test_auto_takes_the_workloads_mix():
    from moemesh.layout import resolve_layout
    from moemesh.settings import partition_arg

    assert resolve_layout(config(), 2, partition=partition_arg("auto")).stage_layers == (5, 3)  # 1:1
    assert resolve_layout(config(), 2, partition=partition_arg("auto:0:1")).stage_layers == (6, 2)  # pure decode
    assert resolve_layout(config(), 2, partition=partition_arg("auto:2000:100")).stage_layers == (4, 4)
    for bad in ["auto:", "auto:1", "auto:1:0", "auto:-1:2", "auto:a:b", "auto:1:2:3"]:
        with pytest.raises(ValueError):
            partition_arg(bad)


def test_generate_takes_auto(tmp_path, capsys):
    assert main(["make-tiny-model", "--arch", "mixtral", "--out", str(tmp_path), "--layers", "4"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--max-tokens", "3",
                 "--temperature", "0", "--layer-partition", "auto", "--json"]) == 0
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--layer-partition", "best"])


def test_measured_costs_price_prompt_and_generated_tokens_apart():
    """A measured head cheaper than its weights (screened) and layers dearer per generated token than
    per prompt token: the split follows the measurement, and is still the best one for it."""
    from moemesh.layout import StepCosts

    model = config()
    # the bench model's float32 figures on one machine (seconds per token, head per sampled row)
    costs = StepCosts.from_measurement(model, {"decode": {"sparse": 63.5e-6}, "prompt": {"sparse": 47.7e-6},
                                               "head": 142e-6})
    assert costs.measured and costs.decode == (63.5e-6,) * 8 and costs.prompt == (47.7e-6,) * 8
    assert balanced_partition(model, 2, 1.0) == (6, 2)  # the weights: the head is ~4.3 layers
    assert balanced_partition(model, 2, 1.0, costs) == (5, 3)  # measured: ~2.2
    heavy = StepCosts((1.0,) * 8, (1.0,) * 8, 6.0)
    assert balanced_partition(model, 2, 1.0, heavy) == (7, 1)
    # prompt tokens priced apart: a share of them moves the split as their own cost says
    cheap_prompts = StepCosts((0.1,) * 8, (1.0,) * 8, 4.0)
    assert balanced_partition(model, 2, 0.5, cheap_prompts) == (6, 2)
    assert balanced_partition(model, 2, 0.5, StepCosts((1.0,) * 8, (1.0,) * 8, 4.0)) == (5, 3)
    for share, c in itertools.product([1.0, 0.5, 0.1], [costs, heavy, cheap_prompts]):
        def worst(counts):
            starts = list(itertools.accumulate(counts, initial=0))
            per = [sum((1 - share) * c.prompt[i] + share * c.decode[i] for i in range(a, b)) for a, b in
                   zip(starts, starts[1:])]
            per[-1] += share * c.head
            return max(per)
        got = balanced_partition(model, 2, share, c)
        assert worst(got) == min(worst((k, 8 - k)) for k in range(1, 8))


def test_measured_costs_map_each_layer_kind():
    from moemesh.layout import StepCosts

    model = config(4, mlp_only=(1,))
    costs = StepCosts.from_measurement(model, {"decode": {"sparse": 2.0, "dense": 1.0},
                                               "prompt": {"sparse": 0.5, "dense": 0.25}, "head": 3.0})
    assert costs.decode == (2.0, 1.0, 2.0, 2.0) and costs.prompt == (0.5, 0.25, 0.5, 0.5) and costs.head == 3.0


def test_the_hand_off_evens_prompts_so_the_split_evens_decodes(monkeypatch):
    """With the MLP hand-off (on in every pipeline unless --no-mlp-handoff) a prompt step moves a
    heavier stage's last MLP to the next one, so a split one layer heavier at the front costs prompt
    steps little; the split is priced per phase, the hand-off applied (`_handoff_partition`). The
    bench model's float32 costs of one measurement (a head about 1.2 layers): without the hand-off
    in the price (4, 4), whose last stage carries the head in every decode step; with it (5, 3)."""
    from moemesh import layout
    from moemesh.layout import StepCosts

    model = config()
    costs = StepCosts((65e-6,) * 8, (102e-6,) * 8, 125e-6)
    assert balanced_partition(model, 2, 64 / 96, costs) == (4, 4)
    assert balanced_partition(model, 2, 64 / 96, costs, handoff=True) == (5, 3)
    assert balanced_partition(model, 2, 0.0, costs, handoff=True) == (4, 4)  # prompts alone: even
    assert balanced_partition(model, 2, 1.0, costs, handoff=True) == balanced_partition(model, 2, 1.0, costs)
    assert balanced_partition(model, 1, 0.5, costs, handoff=True) == (8,)
    # the price, split by split: no other split is cheaper under it
    share = [m / w for m, w in zip(layout.mlp_costs(model), decode_costs(model)[0])]

    def price(counts, sampled):
        bounds = list(itertools.accumulate(counts, initial=0))
        prompt = [sum(costs.prompt[a:b]) for a, b in zip(bounds, bounds[1:])]
        decode = [sum(costs.decode[a:b]) for a, b in zip(bounds, bounds[1:])]
        decode[-1] += costs.head
        for s in range(len(counts) - 1):
            moved = share[bounds[s + 1] - 1] * costs.prompt[bounds[s + 1] - 1]
            if max(prompt[s] - moved, prompt[s + 1] + moved) < max(prompt[s], prompt[s + 1]):
                prompt[s], prompt[s + 1] = prompt[s] - moved, prompt[s + 1] + moved
        return (1 - sampled) * max(prompt) + sampled * max(decode)

    for pp, sampled in itertools.product([2, 3, 4], [0.2, 0.5, 2 / 3, 0.9]):
        got = balanced_partition(model, pp, sampled, costs, handoff=True)
        splits = [c for c in itertools.product(range(1, 9), repeat=pp) if sum(c) == 8]
        assert price(got, sampled) <= min(price(c, sampled) for c in splits) + 1e-12
    # more splits than it tries one by one: the hand-off is left out of the price
    monkeypatch.setattr(layout, "HANDOFF_SPLITS", 5)
    assert balanced_partition(model, 2, 64 / 96, costs, handoff=True) == (4, 4)


def test_resolve_layout_prices_the_hand_off_where_the_pipeline_runs_it():
    """Every caller passes whether its pipeline runs the hand-off (on unless --no-mlp-handoff):
    `resolve_layout` gives `auto` the price of that pipeline."""
    from moemesh.layout import StepCosts, resolve_layout

    costs = StepCosts((65e-6,) * 8, (102e-6,) * 8, 125e-6)
    assert resolve_layout(config(), 2, partition="auto:32:64", costs=costs, handoff=True).stage_layers == (5, 3)
    assert resolve_layout(config(), 2, partition="auto:32:64", costs=costs).stage_layers == (4, 4)
    nan = StepCosts((float("nan"),) * 8, (1.0,) * 8, 1.0)  # (compares with nothing: the price without it)
    assert balanced_partition(config(), 2, 0.5, nan, handoff=True) == balanced_partition(config(), 2, 0.5, nan)
