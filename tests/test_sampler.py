"""The last stage's sampler and the request's SamplingParams.

Statistical checks draw with many different seeds (one seeded row each), so every run sees the
same draws: the tolerances are set so that an honest sampler passes with near certainty for any
seed set, and then the test is deterministic.
"""

import math

import pytest
import torch

from moemesh.sampling import SamplingParams
from stage_worker import sampler
from stage_worker.sampler import SampleRow, _filtered_probs


def sample(logits, params, output_lens, eos_token_ids=(), generator=None):
    """Tokens only, for rows that are described by their parameters and output length alone."""
    rows = [SampleRow(p, [], [0] * n) for p, n in zip(params, output_lens)]
    return sampler.sample(logits, rows, eos_token_ids, generator)[0]

EOS = 0


def logits_from_probs(probs, rows=1):
    return torch.log(torch.tensor(probs, dtype=torch.float32)).repeat(rows, 1)


def seeded_draws(probs, n, first_seed=0, **params):
    """One row per seed, every row the same distribution: n independent draws."""
    params = [SamplingParams(seed=first_seed + i, **params) for i in range(n)]
    return sample(logits_from_probs(probs, n), params, [0] * n)


def frequencies(tokens, vocab):
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return counts / counts.sum()


# ----------------------------------------------------------------------------------------------
# Greedy and degenerate filters


def test_greedy_rows_take_the_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=g)
    expected = logits.argmax(-1).tolist()
    assert sample(logits.clone(), [SamplingParams(temperature=0)] * 8, [0] * 8) == expected
    # mixed with random rows, the greedy rows still take the argmax
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=5.0, seed=i) for i in range(8)]
    got = sample(logits.clone(), params, [0] * 8)
    assert [got[i] for i in range(1, 8, 2)] == [expected[i] for i in range(1, 8, 2)]
    assert [got[i] for i in range(0, 8, 2)] != [expected[i] for i in range(0, 8, 2)]  # hot rows do vary


@pytest.mark.parametrize("params", [
    dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k=1", "top_p=1e-6", "min_p=1"])
def test_filters_that_keep_one_token_give_the_argmax_even_when_hot(params):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 30, generator=g)
    rows = [SamplingParams(temperature=50.0, seed=i, **params) for i in range(64)]
    assert sample(logits.clone(), rows, [0] * 64) == logits.argmax(-1).tolist()
    # without the filter the same hot rows stray from the argmax
    plain = [SamplingParams(temperature=50.0, seed=i) for i in range(64)]
    assert sample(logits.clone(), plain, [0] * 64) != logits.argmax(-1).tolist()


# ----------------------------------------------------------------------------------------------
# Seeds


def test_a_seeded_row_ignores_its_companions_and_its_position():
    g = torch.Generator().manual_seed(2)
    V = 64
    target = torch.randn(V, generator=g)
    others = torch.randn(5, V, generator=g)
    for seed in range(40):
        mine = SamplingParams(temperature=1.3, seed=seed, top_k=20, top_p=0.9)
        alone = sample(target.unsqueeze(0).clone(), [mine], [3])[0]
        companions = [SamplingParams(temperature=0), SamplingParams(temperature=0.7),
                      SamplingParams(temperature=2.0, seed=seed + 1000, min_p=0.1),
                      SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5)]
        for pos in (0, 2, 5):
            rows = companions[:pos] + [mine] + companions[pos:]
            logits = torch.cat([others[:pos], target.unsqueeze(0), others[pos:]]).clone()
            lens = [7] * pos + [3] + [11] * (5 - pos)
            assert sample(logits, rows, lens, eos_token_ids=(EOS,),
                          generator=torch.Generator().manual_seed(seed))[pos] == alone


def test_the_same_seed_draws_afresh_for_each_output_position():
    V = 1000
    logits = torch.zeros(20, V)  # uniform: any repeat would be a coincidence
    params = [SamplingParams(seed=7)] * 20
    tokens = sample(logits.clone(), params, list(range(20)))
    assert len(set(tokens)) >= 18
    assert sample(logits.clone(), params, list(range(20))) == tokens  # and reproducibly so
    assert sample(logits[:1].clone(), [SamplingParams(seed=7)], [4]) == [tokens[4]]
    assert sample(logits[:1].clone(), [SamplingParams(seed=8)], [4]) != [tokens[4]]


def test_unseeded_rows_draw_from_the_given_generator():
    logits = torch.zeros(16, 1000)
    params = [SamplingParams()] * 16
    a = sample(logits.clone(), params, [0] * 16, generator=torch.Generator().manual_seed(3))
    b = sample(logits.clone(), params, [0] * 16, generator=torch.Generator().manual_seed(3))
    c = sample(logits.clone(), params, [0] * 16, generator=torch.Generator().manual_seed(4))
    assert a == b and a != c


# ----------------------------------------------------------------------------------------------
# The distribution

N_DRAWS = 20_000
# A frequency from N independent draws has standard deviation sqrt(p(1-p)/N) <= 0.0035 for
# N = 20,000; 0.02 is more than 5.5 of them, which an honest sampler exceeds on any of four
# tokens with probability < 1e-7. A sampler off by a temperature or a missing renormalisation is
# off by far more than 0.02 on these distributions.
TOL = 0.02


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_the_softmax(temperature):
    probs = [0.1, 0.2, 0.3, 0.4]
    tokens = seeded_draws(probs, N_DRAWS, temperature=temperature)
    expected = torch.tensor(probs, dtype=torch.float64).log().div(temperature).softmax(-1)
    assert (frequencies(tokens, 4) - expected).abs().max() < TOL


def test_top_k_two_never_leaves_the_top_two():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(20, generator=g)
    top2 = set(logits.topk(2).indices.tolist())
    tokens = sample(logits.repeat(2000, 1), [SamplingParams(temperature=5.0, top_k=2, seed=i) for i in range(2000)],
                    [0] * 2000)
    assert set(tokens) == top2


@pytest.mark.parametrize("top_p,kept", [
    (0.35, [3]),  # the top token alone (0.4) reaches 0.35
    (0.65, [3, 2]),  # 0.4 < 0.65 <= 0.7
    (0.8, [3, 2, 1]),  # 0.7 < 0.8 <= 0.9
    (0.95, [3, 2, 1, 0]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    probs = [0.1, 0.2, 0.3, 0.4]
    tokens = seeded_draws(probs, N_DRAWS, top_p=top_p)
    freq = frequencies(tokens, 4)
    expected = torch.zeros(4, dtype=torch.float64)
    expected[kept] = torch.tensor(probs, dtype=torch.float64)[kept]
    expected /= expected.sum()  # renormalised over the kept prefix
    assert set(tokens) == set(kept)
    assert (freq - expected).abs().max() < TOL


@pytest.mark.parametrize("min_p,kept", [(0.25, [0, 1, 2]), (0.5, [0, 1]), (0.7, [0])])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]  # thresholds 0.125, 0.25, 0.35
    tokens = seeded_draws(probs, N_DRAWS, min_p=min_p)
    freq = frequencies(tokens, 4)
    expected = torch.zeros(4, dtype=torch.float64)
    expected[kept] = torch.tensor(probs, dtype=torch.float64)[kept]
    expected /= expected.sum()
    assert set(tokens) == set(kept)
    assert (freq - expected).abs().max() < TOL


@pytest.mark.parametrize("top_p,kept", [(0.5, {3}), (0.75, {2, 3})])
def test_top_p_exactly_reached_by_a_prefix_keeps_only_that_prefix(top_p, kept):
    # binary fractions: the softmax and its cumsum are exact in float32
    assert set(seeded_draws([0.125, 0.125, 0.25, 0.5], 500, top_p=top_p)) == kept


def test_min_p_applies_before_top_p_as_vllm_orders_them():
    """vLLM's order: temperature, min-p, then top-k and top-p over what min-p left (renormalised). min-p
    drops the 0.05s (below 0.2 x 0.4), leaving 0.5 / 0.3125 / 0.1875, whose first two reach top_p 0.7;
    applied after top-p, as before, token 2 (0.65 < 0.7 before it) was drawn too."""
    probs = [0.4, 0.25, 0.15, 0.05, 0.05, 0.05, 0.05]
    tokens = seeded_draws(probs, N_DRAWS, top_p=0.7, min_p=0.2)
    assert set(tokens) == {0, 1}
    assert abs(frequencies(tokens, 7)[0].item() - 0.5 / 0.8125) < TOL


def test_top_k_keeps_every_token_tied_with_the_kth():
    """vLLM cuts top-k by value: three logits tied at the top with top_k=1 are all drawn."""
    logits = torch.tensor([2.0, 2.0, 2.0, 0.0, -1.0])
    tokens = sample(logits.repeat(600, 1), [SamplingParams(top_k=1, seed=i) for i in range(600)], [0] * 600)
    assert set(tokens) == {0, 1, 2}


def test_a_huge_temperature_keeps_the_bans():
    """1e39 is past float32: the temperature as inf made a banned -inf logit NaN, the row all NaN, and
    token 0 drawn whatever was banned. Clamped, the row is uniform over what it may draw."""
    logits = torch.tensor([0.0, 5.0, float("-inf"), 1.0, float("-inf")])
    tokens = sample(logits.repeat(400, 1), [SamplingParams(temperature=1e39, seed=i) for i in range(400)], [0] * 400)
    assert set(tokens) == {0, 1, 3}


def test_top_k_then_top_p_apply_to_the_renormalised_top_k():
    probs = [0.05, 0.15, 0.3, 0.5]
    # top_k=2 leaves {3: 0.625, 2: 0.375}; top_p=0.6 then keeps token 3 alone
    tokens = seeded_draws(probs, 500, top_k=2, top_p=0.6)
    assert set(tokens) == {3}


# ----------------------------------------------------------------------------------------------
# min_tokens


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    V = 16
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 5], logits[0, 9] = 10.0, 9.0, 8.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(5,))
    assert sample(logits.clone(), [p], [2], eos_token_ids=(EOS,)) == [9]  # EOS and 5 banned
    assert sample(logits.clone(), [p], [3], eos_token_ids=(EOS,)) == [EOS]  # reached: allowed again
    # ignore_eos: EOS cannot end the sequence, so only the stop token is banned
    q = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(5,), ignore_eos=True)
    assert sample(logits.clone(), [q], [0], eos_token_ids=(EOS,)) == [EOS]
    logits[0, EOS] = 0.0
    assert sample(logits.clone(), [q], [0], eos_token_ids=(EOS,)) == [9]


def test_min_tokens_bans_eos_for_sampled_rows_and_ignores_ids_outside_the_vocab():
    probs = [0.7, 0.1, 0.1, 0.1]  # EOS is the likeliest token
    n = 2000
    params = [SamplingParams(seed=i, min_tokens=2) for i in range(n)]
    early = sample(logits_from_probs(probs, n), params, [1] * n, eos_token_ids=(EOS, 10_000))
    late = sample(logits_from_probs(probs, n), params, [2] * n, eos_token_ids=(EOS, 10_000))
    assert EOS not in early and set(early) == {1, 2, 3}
    assert abs(late.count(EOS) / n - 0.7) < 0.05


# ----------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize("bad,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
])
def test_sampling_params_reject_bad_values(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_sampling_params_accept_the_edges():
    p = SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=0, min_p=1.0, min_tokens=1)
    assert p.greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_sampling_params_are_validated_when_decoded_from_the_wire():
    import msgspec

    ok = msgspec.json.decode(msgspec.json.encode(SamplingParams(seed=3, top_k=4)), type=SamplingParams)
    assert ok == SamplingParams(seed=3, top_k=4)
    with pytest.raises(ValueError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)


# ----------------------------------------------------------------------------------------------
# Known bug


def test_a_row_without_top_p_keeps_its_whole_distribution_next_to_a_top_p_row():
    logits = torch.zeros(1, 100)
    logits[0, 0] = 20.0  # the 99 tail tokens have ~2e-9 each: the cumsum before them rounds to 1.0
    alone = _filtered_probs(logits.clone(), [SamplingParams()])
    together = _filtered_probs(logits.repeat(2, 1), [SamplingParams(), SamplingParams(top_p=0.5)])[:1]
    assert int((alone > 0).sum()) == 100
    assert int((together > 0).sum()) == 100


@pytest.mark.parametrize("bad", [dict(stop_token_ids=(-1,)), dict(top_k=1 << 31), dict(seed=-1), dict(seed=1 << 63)])
def test_values_a_worker_could_not_use_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_top_k_above_the_vocabulary_means_off_and_a_ban_of_everything_is_ignored():
    logits = torch.randn(1, 5)
    huge = SamplingParams(temperature=1.0, top_k=1 << 30, seed=3)
    off = SamplingParams(temperature=1.0, seed=3)
    assert sample(logits.clone(), [huge], [0]) == sample(logits.clone(), [off], [0])
    everything = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(0, 1, 2, 3, 4))
    assert sample(logits.clone(), [everything], [0]) == [int(logits[0].argmax())]
