"""FP8 (float8_e4m3fn) numbers with float32 scales: the one definition every FP8 user imports.

Legend: E = experts (the leading dimension of a stacked expert weight).

A tensor t is stored as q (e4m3) and a float32 scale, t ~ q * scale, the scale mapping t's largest
finite magnitude to 448 (`fp8_scale`) unless given: one per tensor, or one per expert (`expert_scales`,
`quantize_fp8_per_expert`). Torch only, no Triton, so that the Triton wrapper
(moemesh_kernels.fused_moe_triton), its tuner, the FP8 layers (stage_worker.layers.fp8) and the checkpoint
writer all import it from below.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_MIN_NORMAL = 2.0 ** -6  # below it (times the scale) values are subnormal: spacing 2^-9, absolute error
MIN_AMAX = 1e-12  # an all-zero tensor still gets a positive scale (AutoFP8 clamps the same way)


def finite_amax(t: torch.Tensor) -> torch.Tensor:
    """t's largest finite magnitude (0-dim; 0 for an empty t): an infinity or a NaN in one row of a batch
    leaves the scale, and so every other row, as it would be without it."""
    if t.numel() == 0:
        return torch.zeros((), dtype=t.dtype, device=t.device)
    return torch.nan_to_num(t.detach().abs(), nan=0.0, posinf=0.0).amax()


def fp8_scale(t: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale that maps t's largest finite magnitude to 448: float32, 0-dim."""
    return finite_amax(t).float().clamp(min=MIN_AMAX) / FP8_MAX


def expert_scales(w: torch.Tensor) -> torch.Tensor:
    """w [E, ...] -> [E, 1, ...] float32: each expert's amax / 448, shaped to broadcast against w."""
    dims = tuple(range(1, w.dim()))
    return w.detach().abs().amax(dim=dims, keepdim=True).float().clamp(min=MIN_AMAX) / FP8_MAX


def quantize_fp8(t: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """t -> (q float8_e4m3fn, scale float32) with t ~ q * scale; scale per tensor (amax / 448) unless given
    (any shape that broadcasts against t, e.g. [E, 1, 1] for one scale per expert).

    q = clamp(t / scale, -448, 448) rounded to nearest (ties to even). Error of q * scale against t,
    for each element x = t / scale:
    - |x| >= 2^-6 (normal e4m3): 3 mantissa bits, so the spacing within [2^k, 2^(k+1)) is 2^(k-3) and
      rounding to nearest is off by at most half of it, 2^(k-4) <= 2^-4 |x|: relative error <= 2^-4 = 6.25%.
    - |x| < 2^-6 (subnormal): fixed spacing 2^-9, absolute error <= 2^-10 * scale; |x| <= 2^-10 flushes
      to zero.
    So everywhere |q * scale - t| <= 2^-4 |t| + 2^-10 * scale (plus float32 rounding of t / scale, ~2^-24
    relative). Zero stays exactly zero. With the default scale nothing finite clamps; with a given one (static
    activations) larger values saturate at +-448 * scale.
    """
    scale = fp8_scale(t) if scale is None else scale.float()
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, ...] -> (q float8_e4m3fn [E, ...], scales float32 [E]) with w[e] ~ q[e] * scale[e]."""
    q, scale = quantize_fp8(w, expert_scales(w))
    return q, scale.reshape(-1)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in float32 (every e4m3 value is exact there), then cast to dtype."""
    return (q.float() * scale.float()).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x through fp8 and back, in float32: the activation an fp8 GEMM sees (static scale if given, else
    dynamic per tensor)."""
    return dequantize_fp8(*quantize_fp8(x, scale))
