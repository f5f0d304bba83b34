"""FP8 per-tensor quantization: the error bound, the FP8 checkpoint writer, and the FP8 linear and
expert methods (per-shard scales requantized to their maximum) against dequantized references."""

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from moemesh.config import ConfigError, ModelConfig
from moemesh.entrypoints.quantize import quantize_checkpoint
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
import moemesh_kernels.fp8
from moemesh_kernels.fp8 import FP8_DTYPE, dequantize_fp8, fake_quantize_fp8, quantize_fp8, quantize_fp8_per_expert
from moemesh_kernels.moe_torch import fused_experts, select_experts
from stage_worker.layers.fp8 import Fp8Config, bind_scale_loaders
from stage_worker.layers.fused_moe import FusedMoE
from stage_worker.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                        RowParallelLinear, load_whole)
from stage_worker.layers.parallel import TPGroup
from stage_worker.loader import CheckpointReader
from stage_worker.models import model_class

DYNAMIC, STATIC = Fp8Config("dynamic"), Fp8Config("static")
ONLINE = Fp8Config("dynamic", checkpoint_is_fp8=False)


class Lazy:
    """Stands in for the loader's lazy checkpoint tensor: .shape and indexing."""

    def __init__(self, t: torch.Tensor):
        self.t, self.shape = t, tuple(t.shape)

    def __getitem__(self, index):
        return self.t[index]


def load(layer, name, tensor, shard=None):
    param = getattr(layer, name)
    param.weight_loader(param, Lazy(tensor), shard)


def bound(w, scale):
    """|dequant(quant(w)) - w| allowed per element (quantize_fp8's docstring), with float32 slack."""
    return 2.0 ** -4 * w.abs() * (1 + 2.0 ** -20) + 2.0 ** -10 * scale


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# -- quantize / dequantize --------------------------------------------------------------------


def test_fp8_numbers_import_no_triton():
    """moemesh_kernels.fp8 sits below both the Triton wrapper and the layers: torch only."""
    tree = ast.parse(Path(moemesh_kernels.fp8.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "torch"}, imported


def test_per_expert_quantization_is_each_expert_quantized_alone():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 5, 7, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None, None]
    w[0] = 0  # an all-zero expert still gets a positive scale
    q, scale = quantize_fp8_per_expert(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (3,) and scale.dtype == torch.float32
    for e in range(3):
        q_e, scale_e = quantize_fp8(w[e])
        assert torch.equal(q[e].float(), q_e.float()) and scale[e] == scale_e


@pytest.mark.parametrize("seed", range(6))
def test_roundtrip_error_within_bound(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(257, 65, generator=g) * 10.0 ** (seed - 3)
    if seed % 2:  # heavy tails: most values far below amax, many subnormal or flushed
        w = w * torch.rand(257, 65, generator=g) ** 8
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.dim() == 0
    assert q.float().abs().max() == 448  # amax maps to the largest e4m3 value
    err = (dequantize_fp8(q, scale) - w).abs()
    assert (err <= bound(w, scale)).all()
    normal = w.abs() >= 2.0 ** -6 * scale
    assert (err[normal] / w[normal].abs()).max() > 2.0 ** -5  # the bound is near tight, not vacuous


def test_rounding_is_to_nearest_even_and_saturates():
    scale = torch.tensor(1.0)
    x = torch.tensor([1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, 500.0, -1e6])
    got = dequantize_fp8(*quantize_fp8(x, scale))
    assert got.tolist() == [1.0, 1.25, 0.0, 2.0 ** -8, 448.0, -448.0]


def test_zero_is_exact():
    q, scale = quantize_fp8(torch.zeros(4, 8))
    assert scale > 0 and torch.isfinite(scale)
    assert torch.equal(dequantize_fp8(q, scale), torch.zeros(4, 8))
    w = torch.tensor([0.0, 1.0, -0.0, 3.0])
    assert dequantize_fp8(*quantize_fp8(w))[[0, 2]].eq(0).all()


# -- config -----------------------------------------------------------------------------------


def test_config_from_hf_and_ignored_layers():
    cfg = Fp8Config.from_hf({"quant_method": "fp8", "activation_scheme": "static",
                             "ignored_layers": ["lm_head", "model.layers.0.self_attn.q_proj",
                                                "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
                                                "model.layers.1.mlp.gate_proj"]})
    assert cfg.checkpoint_is_fp8 and cfg.static_activations and cfg.ignored_layers[0] == "lm_head"
    assert Fp8Config.from_hf({"quant_method": "fp8", "activation_scheme": "dynamic"}).ignored_layers == ()
    with pytest.raises(ConfigError, match="not supported"):
        Fp8Config.from_hf({"quant_method": "gptq"})
    with pytest.raises(ConfigError, match="block-wise"):
        Fp8Config.from_hf({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match="static"):
        Fp8Config("static", checkpoint_is_fp8=False)


# -- linear layers ----------------------------------------------------------------------------


def fp8_shard(g, rows, cols, scale):
    """A random fp8 checkpoint tensor and its scale."""
    return (torch.randn(rows, cols, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE), torch.tensor(scale)


@pytest.mark.parametrize("config", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_qkv_shards_requantized_to_max_scale(config):
    g = torch.Generator().manual_seed(0)
    H, D, heads, kv_heads = 32, 8, 4, 2
    layer = QKVParallelLinear(H, D, heads, kv_heads, bias=True, tp=TPGroup(), quant=config)
    bind_scale_loaders(layer)
    shards = {"q": fp8_shard(g, heads * D, H, 0.01), "k": fp8_shard(g, kv_heads * D, H, 0.04),
              "v": fp8_shard(g, kv_heads * D, H, 0.02)}
    input_scales = {"q": 0.03, "k": 0.05, "v": 0.04}
    bias = torch.randn(heads * D + 2 * kv_heads * D, generator=g)
    for sid, (w, s) in shards.items():
        load(layer, "weight", w, sid)
        load(layer, "weight_scale", s, sid)  # shape [] as AutoFP8 writes it
        if config.static_activations:
            load(layer, "input_scale", torch.tensor([input_scales[sid]]), sid)  # shape [1] also taken
    layer.bias.data.copy_(bias)
    assert layer.weight_scale.tolist() == pytest.approx([0.01, 0.04, 0.02])
    layer.process_weights_after_loading()

    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.item() == pytest.approx(0.04)
    want_q = torch.cat([(w.float() * s / 0.04).clamp(-448, 448).to(FP8_DTYPE).float() for w, s in shards.values()])
    assert torch.equal(layer.weight.float(), want_q)
    assert torch.equal(layer.weight[32:48].float(), shards["k"][0].float())  # the max-scale shard is untouched
    original = torch.cat([dequantize_fp8(w, s) for w, s in shards.values()])
    requant_err = (dequantize_fp8(layer.weight, layer.weight_scale) - original).abs()
    assert (requant_err <= 2.0 ** -4 * original.abs() + 2.0 ** -10 * 0.04).all()  # one extra rounding

    x = torch.randn(5, H, generator=g)
    x_scale = torch.tensor(0.05) if config.static_activations else None
    if config.static_activations:
        assert layer.input_scale.item() == pytest.approx(0.05)
    want = F.linear(fake_quantize_fp8(x, x_scale), dequantize_fp8(layer.weight, layer.weight_scale), bias)
    torch.testing.assert_close(layer(x), want)
    assert rel(layer(x), F.linear(x, original, bias)) < 0.1


def test_merged_gate_up_and_row_parallel_rank_slices():
    """Per-rank slices of fp8 weights load through the layer's loader; the whole scalar scale goes to
    every rank."""
    g = torch.Generator().manual_seed(1)
    H, I = 16, 24
    tp = TPGroup(rank=1, size=2)
    gate_up = MergedColumnParallelLinear(H, [I, I], bias=False, tp=tp, quant=STATIC)
    down = RowParallelLinear(I, H, bias=False, tp=tp, quant=STATIC, reduce_results=False)
    bind_scale_loaders(gate_up)
    bind_scale_loaders(down)
    (wg, sg), (wu, su), (wd, sd) = fp8_shard(g, I, H, 0.5), fp8_shard(g, I, H, 0.25), fp8_shard(g, H, I, 0.125)
    for shard, (w, s, a) in enumerate([(wg, sg, 0.1), (wu, su, 0.3)]):
        load(gate_up, "weight", w, shard)
        load(gate_up, "weight_scale", s, shard)
        load(gate_up, "input_scale", torch.tensor(a), shard)
    load(down, "weight", wd)
    load(down, "weight_scale", sd)
    load(down, "input_scale", torch.tensor(0.2))
    gate_up.process_weights_after_loading()
    down.process_weights_after_loading()

    assert gate_up.weight_scale.item() == 0.5 and gate_up.input_scale.item() == pytest.approx(0.3)
    assert torch.equal(gate_up.weight[:12].float(), wg[12:].float())  # rank 1's rows of gate, scale 0.5 kept
    assert torch.equal(gate_up.weight[12:].float(), (wu[12:].float() * 0.5).to(FP8_DTYPE).float())
    assert torch.equal(down.weight.float(), wd[:, 12:].float()) and down.weight_scale.item() == 0.125

    x = torch.randn(7, H, generator=g) * 0.1
    want = F.linear(fake_quantize_fp8(x, torch.tensor(0.3)), dequantize_fp8(gate_up.weight, torch.tensor(0.5)))
    torch.testing.assert_close(gate_up(x), want)
    h = torch.randn(7, I // 2, generator=g)
    torch.testing.assert_close(down(h), F.linear(fake_quantize_fp8(h, torch.tensor(0.2)),
                                                 dequantize_fp8(down.weight, torch.tensor(0.125))))


def test_16bit_checkpoint_quantized_after_loading():
    g = torch.Generator().manual_seed(2)
    layer = ColumnParallelLinear(32, 48, bias=False, tp=TPGroup(), quant=ONLINE)
    assert not hasattr(layer, "weight_scale")  # nothing to read from a 16/32-bit checkpoint
    w = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    load(layer, "weight", w)
    layer.process_weights_after_loading()
    assert layer.weight.dtype == FP8_DTYPE
    assert layer.weight_scale.item() == pytest.approx(w.float().abs().max().item() / 448)
    assert (dequantize_fp8(layer.weight, layer.weight_scale) - w.float()).abs().le(
        bound(w.float(), layer.weight_scale)).all()
    x = torch.randn(3, 32, generator=g, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and rel(y.float(), F.linear(x.float(), w.float())) < 0.1


def test_unloaded_scale_is_an_error():
    layer = ColumnParallelLinear(8, 8, bias=False, tp=TPGroup(), quant=DYNAMIC)
    with pytest.raises(ValueError, match="weight_scale was not"):
        layer.process_weights_after_loading()


# -- experts ----------------------------------------------------------------------------------


def reference_fp8_moe(x, w1, w3, w2, topk_weights, topk_ids, a1=None, a2=None):
    """Token by token, with dequantized weights w1/w3 [E, I, H], w2 [E, H, I] and fp8 activations
    (static scales a1/a2, or dynamic: per tensor over x, and over every routed intermediate)."""
    xq = fake_quantize_fp8(x, a1)
    T, K = topk_ids.shape
    h = {(t, k): F.silu(w1[topk_ids[t, k]] @ xq[t]) * (w3[topk_ids[t, k]] @ xq[t]) for t in range(T) for k in range(K)}
    a2 = torch.stack(list(h.values())).abs().max() / 448 if a2 is None else a2
    out = torch.zeros(T, x.shape[1])
    for (t, k), ht in h.items():
        out[t] += topk_weights[t, k] * (w2[topk_ids[t, k]] @ fake_quantize_fp8(ht, a2))
    return out


def load_experts(layer, w1, w3, w2, s1, s3, s2, a1=None, a3=None, a2=None):
    """Loads global experts' tensors through the parameters' loaders, by FusedMoE.checkpoint_sources."""
    def ckpt(name):
        e, which, suffix = name.split(".", 2)
        e = int(e)
        tensors = {"weight": {"w1": w1, "w3": w3, "w2": w2}, "weight_scale": {"w1": s1, "w3": s3, "w2": s2},
                   "input_scale": {"w1": a1, "w3": a3, "w2": a2}}
        return tensors[suffix][which][e]

    for name, param in layer.named_parameters():
        for src, shard in layer.checkpoint_sources(name):
            param.weight_loader(param, Lazy(ckpt(src)), shard)


def random_experts(g, E, H, I):
    w = lambda *shape: (torch.randn(*shape, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)  # noqa: E731
    s = lambda: torch.rand(E, generator=g) * 0.01 + 0.001  # noqa: E731
    return w(E, I, H), w(E, I, H), w(E, H, I), s(), s(), s()


@pytest.mark.parametrize("config", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_experts_w1_w3_requantized_to_max_scale(config):
    g = torch.Generator().manual_seed(3)
    E, K, H, I, T = 4, 2, 16, 12, 9
    layer = FusedMoE(E, K, H, I, renormalize=True, tp=TPGroup(), quant=config)
    bind_scale_loaders(layer)
    w1, w3, w2, s1, s3, s2 = random_experts(g, E, H, I)
    statics = (torch.rand(E, generator=g), torch.rand(E, generator=g), torch.rand(E, generator=g))
    load_experts(layer, w1, w3, w2, s1, s3, s2, *(statics if config.static_activations else ()))
    torch.testing.assert_close(layer.w13_weight_scale.data, torch.stack([s1, s3], dim=1))
    layer.process_weights_after_loading()

    s13 = torch.maximum(s1, s3)
    torch.testing.assert_close(layer.w13_weight_scale.data, s13)
    torch.testing.assert_close(layer.w2_weight_scale.data, s2)
    requant = lambda w, s: (w.float() * s[:, None, None] / s13[:, None, None]).clamp(-448, 448).to(FP8_DTYPE)  # noqa
    assert torch.equal(layer.w13_weight[:, :I].float(), requant(w1, s1).float())
    assert torch.equal(layer.w13_weight[:, I:].float(), requant(w3, s3).float())
    assert torch.equal(layer.w2_weight.float(), w2.float())
    a1 = a2 = None
    if config.static_activations:
        a1, a2 = torch.maximum(statics[0], statics[1]).max(), statics[2].max()
        assert layer.w13_input_scale.item() == a1.item() and layer.w2_input_scale.item() == a2.item()

    x = torch.randn(T, H, generator=g)
    weights, ids = select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    W1 = dequantize_fp8(layer.w13_weight[:, :I], s13[:, None, None])
    W3 = dequantize_fp8(layer.w13_weight[:, I:], s13[:, None, None])
    W2 = dequantize_fp8(layer.w2_weight, s2[:, None, None])
    got = layer.quant_method.apply(layer, x, weights, ids)
    torch.testing.assert_close(got, reference_fp8_moe(x, W1, W3, W2, weights, ids, a1, a2), rtol=1e-5, atol=1e-5)
    if not config.static_activations:  # fp8 activations stay close to the unquantized product
        original = fused_experts(x, torch.cat([dequantize_fp8(w1, s1[:, None, None]),
                                               dequantize_fp8(w3, s3[:, None, None])], dim=1),
                                 dequantize_fp8(w2, s2[:, None, None]), weights, ids)
        assert rel(got, original) < 0.15


def test_expert_parallel_rank_loads_its_experts_scales():
    g = torch.Generator().manual_seed(4)
    E, K, H, I, T = 4, 2, 8, 6, 11
    tp = TPGroup(rank=1, size=2, expert_parallel=True)
    layer = FusedMoE(E, K, H, I, renormalize=False, tp=tp, quant=DYNAMIC, reduce_results=False)
    bind_scale_loaders(layer)
    w1, w3, w2, s1, s3, s2 = random_experts(g, E, H, I)
    load_experts(layer, w1, w3, w2, s1, s3, s2)
    layer.process_weights_after_loading()
    torch.testing.assert_close(layer.w13_weight_scale.data, torch.maximum(s1, s3)[2:])
    torch.testing.assert_close(layer.w2_weight_scale.data, s2[2:])
    x = torch.randn(T, H, generator=g)
    weights, ids = select_experts(torch.randn(T, E, generator=g), K, renormalize=False)
    s13 = torch.maximum(s1, s3)[:, None, None]
    W1, W3 = dequantize_fp8(w1, s1[:, None, None]), dequantize_fp8(w3, s3[:, None, None])
    W1, W3 = dequantize_fp8(*quantize_fp8(W1, s13)), dequantize_fp8(*quantize_fp8(W3, s13))
    W2 = dequantize_fp8(w2, s2[:, None, None])
    W1[:2], W3[:2], W2[:2] = 0, 0, 0  # rank 0's experts add nothing here
    # the dynamic intermediate scale is per rank: over this rank's routed rows only
    mine = ids >= 2
    want = reference_fp8_moe(x, W1, W3, W2, weights * mine, torch.where(mine, ids, 2))
    torch.testing.assert_close(layer.quant_method.apply(layer, x, weights, ids), want, rtol=1e-5, atol=1e-5)


def test_experts_16bit_checkpoint_one_scale_per_expert():
    g = torch.Generator().manual_seed(5)
    E, K, H, I, T = 3, 2, 8, 10, 6
    layer = FusedMoE(E, K, H, I, renormalize=True, tp=TPGroup(), quant=ONLINE)
    assert not hasattr(layer, "w13_weight_scale")
    w1, w3 = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g) * 3
    w2 = torch.randn(E, H, I, generator=g)
    w1[1] *= 10  # expert 1's w1 sets its shared scale
    load_experts(layer, w1, w3, w2, *[None] * 3)
    layer.process_weights_after_loading()
    w13 = torch.cat([w1, w3], dim=1)
    torch.testing.assert_close(layer.w13_weight_scale.data, w13.abs().amax(dim=(1, 2)) / 448)
    torch.testing.assert_close(layer.w2_weight_scale.data, w2.abs().amax(dim=(1, 2)) / 448)
    err = (dequantize_fp8(layer.w13_weight, layer.w13_weight_scale[:, None, None]) - w13).abs()
    assert (err <= bound(w13, layer.w13_weight_scale[:, None, None])).all()
    x = torch.randn(T, H, generator=g)
    weights, ids = select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    assert rel(layer.quant_method.apply(layer, x, weights, ids), fused_experts(x, w13, w2, weights, ids)) < 0.15


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_row_leaves_the_other_rows_finite(backend, bad):
    """Dynamic activation scales come from the finite values: an infinity or a NaN in one request's row
    leaves every other row of the batch finite (it had made every row NaN). A NaN row weighs in the
    scales as a row of zeros would; an infinity saturates at 448 times the scale."""
    g = torch.Generator().manual_seed(6)
    E, K, H, I, T = 4, 2, 64, 32, 6
    moe = FusedMoE(E, K, H, I, renormalize=True, tp=TPGroup(), quant=ONLINE)
    load_experts(moe, torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                 torch.randn(E, H, I, generator=g), *[None] * 3)
    lin = ColumnParallelLinear(H, 48, bias=False, tp=TPGroup(), quant=ONLINE)
    load(lin, "weight", torch.randn(48, H, generator=g))
    for layer in (moe, lin):
        layer.backend = backend
        layer.process_weights_after_loading()
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    zeroed, bad_x = x.clone(), x.clone()
    zeroed[3] = 0
    bad_x[3] = 0
    bad_x[3, 0] = bad
    others = [0, 1, 2, 4, 5]
    for run in (lambda v: lin(v), lambda v: moe(v, logits)):
        got = run(bad_x)
        assert torch.isfinite(got[others]).all()
        if bad != bad:
            torch.testing.assert_close(got[others], run(zeroed)[others], rtol=0, atol=0)


# -- checkpoint writer ------------------------------------------------------------------------


def read_all(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


QUANTIZED_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}
SPECS = {
    "mixtral": TinyModelSpec(arch="mixtral", num_layers=2, hidden_size=32, intermediate_size=48, num_experts=4,
                             vocab_size=320),
    "qwen2_moe": TinyModelSpec(arch="qwen2_moe", num_layers=3, hidden_size=32, moe_intermediate_size=24,
                               shared_expert_intermediate_size=40, num_experts=4, decoder_sparse_step=2,
                               vocab_size=320, dtype="bfloat16", max_shard_bytes=40_000),
}


@pytest.mark.parametrize("arch", list(SPECS))
def test_quantize_checkpoint(arch, tmp_path):
    src, dst = write_tiny_model(SPECS[arch], tmp_path / "src"), tmp_path / "fp8"
    quantize_checkpoint(src, dst, progress=False)
    before, after = read_all(src), read_all(dst)

    quantized = {n for n in before
                 if n.startswith("model.layers.") and n.endswith(".weight") and n.split(".")[-2] in QUANTIZED_LEAVES}
    assert any(".experts.3." in n for n in quantized) and any(".o_proj." in n for n in quantized)
    if arch == "qwen2_moe":  # the shared expert, and layer 0's dense MLP
        assert "model.layers.1.mlp.shared_expert.down_proj.weight" in quantized
        assert "model.layers.0.mlp.up_proj.weight" in quantized
    scales = {n.removesuffix(".weight") + ".weight_scale" for n in quantized}
    assert set(after) == set(before) | scales
    for name, t in before.items():
        if name in quantized:
            q, s = after[name], after[name.removesuffix(".weight") + ".weight_scale"]
            assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == ()
            assert s.item() == pytest.approx(t.float().abs().max().item() / 448)
            assert (dequantize_fp8(q, s) - t.float()).abs().le(bound(t.float(), s)).all()
        else:  # embeddings, norms, biases, lm_head, router gates: the same bytes
            assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    gates = [n for n in before if n.endswith((".gate.weight", ".shared_expert_gate.weight"))]
    assert gates and not scales & {g.removesuffix(".weight") + ".weight_scale" for g in gates}

    config = json.loads((dst / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == json.loads((src / "config.json").read_text())
    assert qc["quant_method"] == "fp8" and qc["activation_scheme"] == "dynamic"
    assert qc["ignored_layers"] == ["lm_head"] + [g.removesuffix(".weight") for g in gates]
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    if SPECS[arch].max_shard_bytes:
        weight_map = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(weight_map) == set(after) and len(set(weight_map.values())) > 1
        for name, file in weight_map.items():
            with safe_open(str(dst / file), framework="pt") as h:
                assert name in h.keys()

    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(dst, tmp_path / "again", progress=False)
    with pytest.raises(ValueError, match="calibration"):
        quantize_checkpoint(src, tmp_path / "static", activation_scheme="static", progress=False)


@pytest.mark.parametrize("arch", list(SPECS))
def test_quantized_checkpoint_loads_into_fp8_model(arch, tmp_path):
    """The writer's names are what the model's FP8 parameters ask for (load_model's loop, with the scale
    loaders bound): every quantized weight matches the original within the bound; gates stay exact."""
    src, dst = write_tiny_model(SPECS[arch], tmp_path / "src"), tmp_path / "fp8"
    quantize_checkpoint(src, dst, progress=False)
    config = ModelConfig.from_dir(dst)
    quant = Fp8Config.from_hf(json.loads((dst / "config.json").read_text())["quantization_config"])
    model = model_class(config)(config, None, TPGroup(), quant)
    bind_scale_loaders(model)
    reader = CheckpointReader(dst)
    for name, param in model.named_parameters():
        for ckpt_name, shard in model.checkpoint_sources(name):
            getattr(param, "weight_loader", load_whole)(param, reader.get(ckpt_name), shard)
    model.process_weights_after_loading()

    original = read_all(src)
    layer = model.model.layers["1"]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE
    want = torch.cat([original[f"model.layers.1.self_attn.{p}_proj.weight"].float() for p in "qkv"])
    assert (dequantize_fp8(qkv.weight, qkv.weight_scale) - want).abs().le(
        2 * bound(want, qkv.weight_scale)).all()  # requantized to the largest of three scales: two roundings
    moe = layer.mlp
    prefix = "model.layers.1." + ("block_sparse_moe" if arch == "mixtral" else "mlp")
    gate = original[f"{prefix}.gate.weight"]
    assert moe.gate.weight.dtype == torch.float32 and torch.equal(moe.gate.weight, gate.float())  # not quantized
    names = ("w1", "w2") if arch == "mixtral" else ("gate_proj", "down_proj")
    w1 = torch.stack([original[f"{prefix}.experts.{e}.{names[0]}.weight"].float() for e in range(4)])
    w2 = torch.stack([original[f"{prefix}.experts.{e}.{names[1]}.weight"].float() for e in range(4)])
    I = moe.experts.intermediate_size_per_partition
    s13, s2 = moe.experts.w13_weight_scale[:, None, None], moe.experts.w2_weight_scale[:, None, None]
    assert (dequantize_fp8(moe.experts.w13_weight[:, :I], s13) - w1).abs().le(2 * bound(w1, s13)).all()
    assert (dequantize_fp8(moe.experts.w2_weight, s2) - w2).abs().le(bound(w2, s2)).all()
    if arch == "qwen2_moe":
        assert moe.shared_expert.down_proj.weight.dtype == FP8_DTYPE
        assert moe.shared_expert_gate.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32
