"""FP8 (float8_e4m3fn) weights with per-tensor scales: the "fp8" checkpoint layout of AutoFP8 and vLLM.

Legend: S = checkpoint tensors fused into one linear (q/k/v: 3, gate/up: 2, otherwise 1),
E = experts on this rank (`num_local_experts`), H = hidden, I = this rank's expert intermediate size.

A weight is stored as q (float8_e4m3fn) and a float32 scale, w ~ q * scale. Two kinds of checkpoint:
- FP8 (`quantization_config.quant_method == "fp8"`, from AutoFP8 or `moemesh.entrypoints.quantize`): every
  quantized Linear has `weight` (fp8) and a scalar `weight_scale`, plus a scalar `input_scale` when
  activations are static.
- 16/32-bit: weights load in the model dtype and are quantized here, after loading (scale = amax / 448).

Fused weights, one scale. The checkpoint's q, k and v (gate and up; each expert's w1 and w3) carry a
scale each, while a fused weight has one. The per-shard scales load into slots ([S], or [E, 2] for
w1/w3) and after loading every shard is requantized to the largest of them:
    q_i' = round(q_i * s_i / s_max)      (s_max >= s_i, so nothing can overflow)
A shard whose scale was smaller is rounded a second time, on a grid s_max / s_i times coarser than
its own; its error is then at most its first rounding's plus half an ULP of the coarser grid. vLLM
does the same. Static input scales of fused shards (and of all experts) become their maximum; with
--expert-parallel, of the rank's own experts, so ranks may quantize activations a little differently
(as vLLM's do). A checkpoint's KV-cache scales (k_scale, v_scale, kv_cache_scheme) are not read: the
KV cache stays in the model's dtype.

Activations are quantized too: with the checkpoint's `input_scale` ("static") or with a scale taken
per tensor from each input ("dynamic", amax / 448). Here that is simulated: inputs and weights go
through fp8 and back, and the product runs in float32 (what an fp8 GEMM accumulates in), cast back
to the input dtype. Correct, not fast: weights are dequantized on every call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.config import ConfigError, ModelConfig, check_fp8_checkpoint, check_quantization
from moemesh_kernels.fp8 import (FP8_DTYPE, dequantize_fp8, fake_quantize_fp8, finite_amax, fp8_scale, quantize_fp8,
                                 quantize_fp8_per_expert)
from stage_worker.layers.linear import cpu_gemm_layout

# -- config -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Config:
    """How a model's Linear and expert weights are quantized.

    activation_scheme: "dynamic" (a scale per input tensor, computed on the fly) or "static" (the
        checkpoint's calibrated `input_scale`s; needs an FP8 checkpoint).
    checkpoint_is_fp8: the checkpoint already holds fp8 weights and scales; else they are quantized
        after loading.
    ignored_layers: checkpoint module names left unquantized (e.g. "lm_head"): only layers moemesh
        never quantizes may be listed (moemesh.config refuses others at load).
    """

    activation_scheme: str = "dynamic"
    checkpoint_is_fp8: bool = True
    ignored_layers: tuple[str, ...] = ()

    def __post_init__(self):
        if self.activation_scheme not in ("dynamic", "static"):
            raise ConfigError(f"FP8 activation_scheme {self.activation_scheme!r} is not one of dynamic, static")
        if self.activation_scheme == "static" and not self.checkpoint_is_fp8:
            raise ConfigError("static FP8 activation scales come from an FP8 checkpoint; "
                              "quantizing a 16/32-bit checkpoint at load time needs activation_scheme dynamic")
        object.__setattr__(self, "ignored_layers", tuple(self.ignored_layers))

    @classmethod
    def from_hf(cls, quantization_config: dict) -> "Fp8Config":
        """From config.json's `quantization_config` as AutoFP8 writes it:
        {"quant_method": "fp8", "activation_scheme": "dynamic" | "static", "ignored_layers": [...]}."""
        check_fp8_checkpoint(quantization_config)
        return cls(activation_scheme=quantization_config.get("activation_scheme", "dynamic"),
                   checkpoint_is_fp8=True,
                   ignored_layers=tuple(quantization_config.get("ignored_layers") or ()))

    @property
    def static_activations(self) -> bool:
        return self.activation_scheme == "static"

    def linear_method(self) -> "Fp8LinearMethod":
        return Fp8LinearMethod(self)

    def moe_method(self) -> "Fp8FusedMoEMethod":
        return Fp8FusedMoEMethod(self)


# -- loading scales ---------------------------------------------------------------------------


def bind_scale_loaders(module: nn.Module) -> None:
    """Points every FP8 scale parameter under `module` (`*_scale`) at its method's `load_scale`.

    The methods' `create_weights` call this for their layer, but `LinearBase` and `FusedMoE` then give
    every parameter the layer's own loader, which slices by tensor rank and cannot place a scalar
    scale. Until they keep a loader a method has set, call this on the built model before loading."""
    for m in module.modules():
        method = getattr(m, "quant_method", None)
        if isinstance(method, (Fp8LinearMethod, Fp8FusedMoEMethod)):
            for name, p in m.named_parameters(recurse=False):
                if name.endswith("_scale"):
                    p.weight_loader = functools.partial(method.load_scale, m)


def _scalar(tensor) -> torch.Tensor:
    """A checkpoint scale (shape [] as AutoFP8 writes it, or [1]) -> 0-dim float32. Scales are per
    tensor, so every tensor rank reads the whole (one-element) tensor: no slicing."""
    value = tensor[...]
    if value.numel() != 1:
        raise ValueError(f"shape {tuple(tensor.shape)} in checkpoint, expected a per-tensor scale (one element)")
    return value.reshape(()).float()


def _check_loaded(layer: nn.Module, name: str) -> torch.Tensor:
    value = getattr(layer, name).data
    if torch.isnan(value).any():
        raise ValueError(f"{type(layer).__name__}.{name} was not (fully) loaded from the checkpoint")
    return value


def _shards(layer: nn.Module) -> list[tuple[object, int, int]]:
    """(shard id, first row, rows) of each checkpoint tensor fused into this rank's weight: q/k/v of a
    QKVParallelLinear (`layer.shards`), the parts of a MergedColumnParallelLinear (`layer.output_sizes`),
    else the one whole weight (shard id None)."""
    if hasattr(layer, "shards"):
        return [(sid, offset, rows) for sid, (offset, rows, _) in layer.shards.items()]
    if hasattr(layer, "output_sizes"):
        offsets = [sum(layer.output_sizes[:i]) for i in range(len(layer.output_sizes))]
        return [(i, offset, rows) for i, (offset, rows) in enumerate(zip(offsets, layer.output_sizes))]
    return [(None, 0, layer.output_size)]


def _nan(*shape: int) -> nn.Parameter:
    """A scale not loaded yet (NaN until the checkpoint fills it; checked after loading)."""
    return nn.Parameter(torch.full(shape, float("nan"), dtype=torch.float32), requires_grad=False)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


# -- linear layers ----------------------------------------------------------------------------


class Fp8LinearMethod:
    """weight [out, in] fp8 and weight_scale: [S] while loading, 0-dim after; input_scale likewise
    (static activations only)."""

    def __init__(self, config: Fp8Config):
        self.config = config

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        if not self.config.checkpoint_is_fp8:  # model dtype now, quantized after loading
            layer.weight = _param(torch.empty(output_size, input_size))
            return
        S = len(_shards(layer))
        layer.weight = _param(torch.empty(output_size, input_size, dtype=FP8_DTYPE))
        layer.weight_scale = _nan(S)
        if self.config.static_activations:
            layer.input_scale = _nan(S)
        bind_scale_loaders(layer)

    def load_scale(self, layer: nn.Module, param: nn.Parameter, tensor, shard_id=None) -> None:
        """A checkpoint tensor's scalar scale -> its shard's slot."""
        slot = [sid for sid, _, _ in _shards(layer)].index(shard_id)
        param.data[slot] = _scalar(tensor)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.checkpoint_is_fp8:
            q, scale = quantize_fp8(layer.weight.data)
        else:
            scales = _check_loaded(layer, "weight_scale")  # [S]
            q, scale = layer.weight.data, scales.max()
            for (_, offset, rows), s in zip(_shards(layer), scales):
                if s != scale:  # requantize this shard to the common (largest) scale
                    q[offset:offset + rows] = quantize_fp8(dequantize_fp8(q[offset:offset + rows], s), scale)[0]
            if self.config.static_activations:
                layer.input_scale = _param(_check_loaded(layer, "input_scale").max())
        layer.weight = _param(cpu_gemm_layout(q))
        layer.weight_scale = _param(scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        w = dequantize_fp8(layer.weight, layer.weight_scale)  # [out, in] float32
        xq = fake_quantize_fp8(x, layer.input_scale if self.config.static_activations else None)
        y = F.linear(xq, w, None if bias is None else bias.float())
        return y.to(x.dtype)


# -- experts ----------------------------------------------------------------------------------


class Fp8FusedMoEMethod:
    """w13_weight [E, 2I, H] and w2_weight [E, H, I] fp8; w13_weight_scale [E, 2] (w1, w3) while loading,
    [E] after; w2_weight_scale [E]; static activations: w13_input_scale [E, 2] and w2_input_scale [E]
    while loading, 0-dim after (one scale for all of the rank's experts' inputs, as a fused GPU kernel
    quantizes the routed rows together).

    Parameter names are what `FusedMoE.checkpoint_sources` maps to the checkpoint: w13_weight_scale ->
    `experts.{e}.w1.weight_scale` and `experts.{e}.w3.weight_scale`, and so on."""

    def __init__(self, config: Fp8Config):
        self.config = config
        self.experts = self.dequantized_experts  # process_weights_after_loading binds the backend's

    def create_weights(self, layer: nn.Module) -> None:
        E, H, I = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_partition
        if not self.config.checkpoint_is_fp8:  # model dtype now, quantized after loading
            layer.w13_weight = _param(torch.empty(E, 2 * I, H))
            layer.w2_weight = _param(torch.empty(E, H, I))
            return
        layer.w13_weight = _param(torch.empty(E, 2 * I, H, dtype=FP8_DTYPE))
        layer.w2_weight = _param(torch.empty(E, H, I, dtype=FP8_DTYPE))
        layer.w13_weight_scale, layer.w2_weight_scale = _nan(E, 2), _nan(E)
        if self.config.static_activations:
            layer.w13_input_scale, layer.w2_input_scale = _nan(E, 2), _nan(E)
        bind_scale_loaders(layer)

    def load_scale(self, layer: nn.Module, param: nn.Parameter, tensor, shard_id: tuple[int, str]) -> None:
        """Expert e's w1/w3/w2 scalar scale -> param[e] (w13 scales: param[e, 0] for w1, [e, 1] for w3)."""
        e, which = shard_id
        if param.dim() == 2:
            param.data[e, 0 if which == "w1" else 1] = _scalar(tensor)
        else:
            param.data[e] = _scalar(tensor)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.checkpoint_is_fp8:
            # one scale per expert; w1 and w3 share it (the amax over both halves)
            w13_q, w13_scale = quantize_fp8_per_expert(layer.w13_weight.data)
            w2_q, w2_scale = quantize_fp8_per_expert(layer.w2_weight.data)
        else:
            I = layer.intermediate_size_per_partition
            scales = _check_loaded(layer, "w13_weight_scale")  # [E, 2]
            w13_scale = scales.amax(dim=1)  # [E]
            w13_q = layer.w13_weight.data
            for half in range(2):  # requantize w1 (rows :I) and w3 (rows I:) to the larger scale
                rows = slice(half * I, (half + 1) * I)
                s = scales[:, half, None, None]  # [E, 1, 1]
                w13_q[:, rows] = quantize_fp8(dequantize_fp8(w13_q[:, rows], s), w13_scale[:, None, None])[0]
            w2_q, w2_scale = layer.w2_weight.data, _check_loaded(layer, "w2_weight_scale")[:, None, None]
            if self.config.static_activations:
                layer.w13_input_scale = _param(_check_loaded(layer, "w13_input_scale").max())
                layer.w2_input_scale = _param(_check_loaded(layer, "w2_input_scale").max())
        layer.w13_weight, layer.w13_weight_scale = _param(cpu_gemm_layout(w13_q)), _param(w13_scale.reshape(-1))
        layer.w2_weight, layer.w2_weight_scale = _param(cpu_gemm_layout(w2_q)), _param(w2_scale.reshape(-1))
        # "native" has no fp8 kernels: its experts dequantize, as torch's do
        self.experts = self.bind_triton() if layer.backend == "triton" else self.dequantized_experts

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_* [T, K] -> [T, H] in x's dtype, by the kernel bound for the layer's backend."""
        return self.experts(layer, x, topk_weights, topk_ids)

    def bind_triton(self):
        """The Triton kernel on the fp8 operands: w8a8 with the static input scales, else the weights
        dequantized in the kernel (w8a16)."""
        from moemesh_kernels.fused_moe_triton import fused_experts_triton

        static = self.config.static_activations

        def experts(layer, x, topk_weights, topk_ids):
            return fused_experts_triton(x.contiguous(), layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                        expert_offset=layer.expert_offset, w13_scale=layer.w13_weight_scale,
                                        w2_scale=layer.w2_weight_scale,
                                        a13_scale=layer.w13_input_scale.reshape(1) if static else None,
                                        a2_scale=layer.w2_input_scale.reshape(1) if static else None)
        return experts

    def dequantized_experts(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_* [T, K] -> [T, H] in x's dtype. For each local expert e and its routed rows:
            h = silu(xq @ w1_e^T) * (xq @ w3_e^T)    [n, I]   xq: x through fp8 (w13_input_scale, or dynamic)
            y = hq @ w2_e^T                           [n, H]   hq: h through fp8 (w2_input_scale, or dynamic
                                                               over all routed rows of all experts)
        Not `moe_torch.fused_experts`: it has no place to quantize h. Experts are numbered globally;
        those of other ranks (expert parallelism) are skipped."""
        static = self.config.static_activations
        xq = fake_quantize_fp8(x, layer.w13_input_scale if static else None)  # [T, H] float32
        local_ids = topk_ids - layer.expert_offset  # [T, K]
        routed = []  # (tokens [n], their routing weights [n], e, h [n, I])
        for e in range(layer.num_local_experts):
            tokens, k = (local_ids == e).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            w13 = dequantize_fp8(layer.w13_weight[e], layer.w13_weight_scale[e])  # [2I, H]
            gate, up = F.linear(xq[tokens], w13).chunk(2, dim=-1)
            routed.append((tokens, topk_weights[tokens, k].float(), e, F.silu(gate) * up))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if not routed:
            return out.to(x.dtype)
        if static:
            h_scale = layer.w2_input_scale
        else:
            h_scale = fp8_scale(torch.stack([finite_amax(h) for *_, h in routed]))  # over every routed row
        for tokens, weights, e, h in routed:
            w2 = dequantize_fp8(layer.w2_weight[e], layer.w2_weight_scale[e])  # [H, I]
            out.index_add_(0, tokens, F.linear(fake_quantize_fp8(h, h_scale), w2) * weights[:, None])
        return out.to(x.dtype)


__all__ = ["Fp8Config", "Fp8FusedMoEMethod", "Fp8LinearMethod", "bind_scale_loaders"]


def resolve_quantization(model: ModelConfig, flag: str | None):
    """The quantization method a stage builds its layers with (moemesh.config.check_quantization
    decides which, and refuses what cannot run): an Fp8Config for an FP8 checkpoint or `--quantization
    fp8` (16/32-bit weights quantized in place at load, dynamic activation scales), an Int8Config for
    `--quantization int8` (stage_worker.layers.int8), or None."""
    method = check_quantization(model, flag)
    if method == "int8":
        from stage_worker.layers.int8 import Int8Config

        return Int8Config()
    if model.quantization is not None:
        return Fp8Config.from_hf(dict(model.quantization_config))
    return Fp8Config("dynamic", checkpoint_is_fp8=False) if method == "fp8" else None
