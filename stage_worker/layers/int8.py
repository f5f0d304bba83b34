"""Weight-only int8 for the CPU (`--quantization int8`), the counterpart of llama.cpp's Q8_0.

Legend: N = output features, K = input features, E = experts on this rank.

Weights load in the model dtype and are quantized after loading, symmetric with one float32 scale
per output feature (per row of [N, K]; per expert and row for the experts):
    scale[n] = max_k |w[n, k]| / 127,   q[n, k] = round(w[n, k] / scale[n])   (int8, -127..127)
so |q * scale - w| <= scale / 2 per element. Every Linear (attention, dense and shared-expert MLPs),
every routed expert and the lm_head are quantized; the router gates and norms are not (the gates are
built without a quantization config, as in FP8).

Activations stay in the model dtype. With the native backend the kernels (kernels/cpu_gemm.c) read
the int8 weights, a quarter of float32's bytes, widen them in registers and apply the scale once per
output; that is the point of it, since a decode step is bound by reading weights. With the torch
backend the weights are dequantized once after loading, into the model dtype: the same numbers in
float32 (under bfloat16 they are rounded once more), no speed-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moemesh_kernels import cpu_gemm
from stage_worker.layers.fused_moe import UnquantizedFusedMoEMethod
from stage_worker.layers.linear import UnquantizedLinearMethod


def fake_quantize_int8(w: torch.Tensor) -> torch.Tensor:
    """w through per-row int8 and back, in w's dtype (what the torch backend multiplies by)."""
    q, scale = cpu_gemm.quantize_int8(w)
    return (q.float() * scale.unsqueeze(-1)).to(w.dtype)


@dataclass(frozen=True)
class Int8Config:
    lm_head_weight_type = torch.int8  # CausalLM packs its lm_head in this type (native backend)

    def linear_method(self) -> "Int8LinearMethod":
        return Int8LinearMethod()

    def moe_method(self) -> "Int8FusedMoEMethod":
        return Int8FusedMoEMethod()


class Int8LinearMethod(UnquantizedLinearMethod):
    """weight [N, K] in the model dtype while loading; after: `layer.packed` (int8 + scales, native)
    or the dequantized weight (torch)."""

    native_weight_type = torch.int8
    torch_weight = staticmethod(fake_quantize_int8)


class Int8FusedMoEMethod(UnquantizedFusedMoEMethod):
    """w13_weight [E, 2I, H] and w2_weight [E, H, I] in the model dtype while loading; after: packed
    int8 with a scale per expert row (native), or dequantized (torch, triton)."""

    native_weight_type = torch.int8
    torch_weight = staticmethod(fake_quantize_int8)
