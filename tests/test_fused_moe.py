"""The FusedMoE CPU backend (and the MoE block around it) against the slow reference."""

import random

import pytest
import torch

from moemesh.config import ModelConfig, RopeConfig
from moemesh_kernels import cpu_gemm
from moemesh_kernels.moe_torch import fused_experts, select_experts
from reference_moe import reference_moe
from stage_worker.layers.fused_moe import FusedMoE
from stage_worker.layers.linear import ColumnParallelLinear
from stage_worker.layers.parallel import TPGroup
from stage_worker.models.moe import SparseMoeBlock


def moe_config(H, I, E, K, renormalize, shared_I):
    return ModelConfig(model_type="qwen2_moe", vocab_size=10, hidden_size=H, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=H, intermediate_size=I, rms_norm_eps=1e-6, rope=RopeConfig(),
                       max_position_embeddings=16, num_experts=E, top_k=K, moe_intermediate_size=I,
                       norm_topk_prob=renormalize, shared_expert_intermediate_size=shared_I)


def random_case(seed):
    rng = random.Random(seed)
    E = rng.randint(1, 16)
    return dict(T=rng.randint(1, 300), E=E, K=rng.randint(1, min(4, E)), H=rng.choice([8, 16, 24]),
                I=rng.choice([8, 12, 32]), renormalize=rng.random() < 0.5, shared=rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(24))
def test_moe_block_matches_reference(seed):
    c = random_case(seed)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5  # noqa: E731
    H, I, E = c["H"], c["I"], c["E"]
    block = SparseMoeBlock(moe_config(H, I, E, c["K"], c["renormalize"], 2 * I if c["shared"] else 0), TPGroup(),
                           None, ("gate_proj", "up_proj", "down_proj"))
    w1, w3, w2, gate = rand(E, I, H), rand(E, I, H), rand(E, H, I), 3 * rand(E, H)
    block.gate.weight.data.copy_(gate)
    block.experts.w13_weight.data.copy_(torch.cat([w1, w3], dim=1))
    block.experts.w2_weight.data.copy_(w2)
    shared = None
    if c["shared"]:
        shared = (rand(2 * I, H), rand(2 * I, H), rand(H, 2 * I), rand(1, H))
        block.shared_expert.gate_up_proj.weight.data.copy_(torch.cat(shared[:2]))
        block.shared_expert.down_proj.weight.data.copy_(shared[2])
        block.shared_expert_gate.weight.data.copy_(shared[3])
    x = torch.randn(c["T"], H, generator=g)
    want = reference_moe(x, gate, w1, w3, w2, c["K"], c["renormalize"], shared)
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_partial_sums_add_up(ranks):
    """Each rank computing only its experts (expert_offset) gives partial sums that add to the whole."""
    g = torch.Generator().manual_seed(1)
    T, E, H, I, K = 37, 8, 16, 24, 2
    x, w13, w2 = torch.randn(T, H, generator=g), torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    weights, ids = select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    whole = fused_experts(x, w13, w2, weights, ids)
    per = E // ranks
    parts = [fused_experts(x, w13[r * per:(r + 1) * per], w2[r * per:(r + 1) * per], weights, ids,
                           expert_offset=r * per) for r in range(ranks)]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-4)


def test_routing_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]] and w.sum().item() < 0.99
    w, _ = select_experts(logits, 2, renormalize=True)
    assert abs(w.sum().item() - 1) < 1e-6


def test_experts_with_no_tokens_are_skipped():
    """Only the experts that received tokens compute (one matmul each)."""
    calls = []
    T, E, H, I = 5, 6, 8, 4
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.tensor([[1], [4], [1], [1], [4]])
    import torch.nn.functional as F
    orig = F.linear
    try:
        F.linear = lambda a, w, *r: (calls.append(a.shape[0]), orig(a, w, *r))[1]
        fused_experts(x, w13, w2, torch.ones(T, 1), ids)
    finally:
        F.linear = orig
    assert calls == [3, 3, 2, 2]  # expert 1: w13 then w2 on 3 rows; expert 4: on 2 rows


def laid_out_experts(backend, seed=0):
    """A FusedMoE with random weights, laid out for `backend`, and an input for it."""
    g = torch.Generator().manual_seed(seed)
    T, E, K, H, I = 6, 4, 2, 8, 12
    layer = FusedMoE(E, K, H, I, renormalize=True, tp=TPGroup())
    layer.w13_weight.data.copy_(torch.randn(E, 2 * I, H, generator=g))
    layer.w2_weight.data.copy_(torch.randn(E, H, I, generator=g))
    layer.backend = backend
    layer.process_weights_after_loading()
    return layer, torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)


def test_the_backend_is_bound_when_the_weights_are_laid_out(monkeypatch):
    """Forward calls the kernels bound by process_weights_after_loading and never reads `backend`
    again: a layer laid out for torch computes with torch after `backend` says native."""
    layer, x, logits = laid_out_experts("torch")
    linear = ColumnParallelLinear(8, 16, bias=False, tp=TPGroup())
    linear.weight.data.normal_()
    linear.process_weights_after_loading()
    want, want_linear = layer(x, logits), linear(x)

    def refuse(*args, **kwargs):
        raise AssertionError("a native kernel ran in a layer laid out for torch")

    for name in ("topk_softmax", "fused_moe", "linear"):
        monkeypatch.setattr(cpu_gemm, name, refuse)
    layer.backend = linear.backend = "native"
    assert torch.equal(layer(x, logits), want) and torch.equal(linear(x), want_linear)


def test_a_layer_laid_out_for_native_keeps_its_native_kernels(monkeypatch):
    if cpu_gemm.native() is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    layer, x, logits = laid_out_experts("native")
    assert layer.packed is not None
    calls = []
    for name in ("topk_softmax", "fused_moe"):
        kernel = getattr(cpu_gemm, name)
        monkeypatch.setattr(cpu_gemm, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])
    layer.backend = "torch"
    y = layer(x, logits)
    assert calls == ["topk_softmax", "fused_moe"]
    torch.testing.assert_close(y, laid_out_experts("torch")[0](x, logits), rtol=1e-4, atol=1e-3)
