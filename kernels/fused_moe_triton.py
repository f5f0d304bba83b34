"""Fused-MoE in Triton: routing (top-k softmax), block alignment, and the grouped expert GEMM.

Legend: T = tokens, E = experts (held by this rank), K = experts per token (top-k),
H = hidden size, I = intermediate size (this rank's share), S = T * K routed slots
(slot s = t * K + k is token t's k-th choice), P = length of the padded, expert-sorted slot list.
GEMMs: C[S, N] = A[rows, D] @ B[e, N, D]^T; D is the reduction ("K" of a plain GEMM, renamed to keep
K for top-k); tiles are BLOCK_M slots x BLOCK_N output columns, reduced over D in BLOCK_K steps.

The pipeline of `fused_experts_triton` (same maths as `moemesh_kernels.moe_torch.fused_experts`):
  1. `moe_align_block_size`: the S slots sorted by expert, each expert's run padded to a multiple of
     BLOCK_M with the sentinel S, so every BLOCK_M block of sorted slots belongs to one expert.
  2. `fused_moe_kernel` on w13: gathers x[slot // K], [S, 2I] = x @ w13[e]^T.
  3. SiLU(gate) * up -> [S, I].
  4. `fused_moe_kernel` on w2 with the routing weight: [S, H]; then sum over K -> [T, H].

Backends: on CUDA tensors the kernels compile for the GPU. On CPU tensors they run only in Triton's
interpreter, which is chosen when the kernels are decorated: `TRITON_INTERPRET=1` must be set before
this module is imported. The interpreter computes bf16 wrongly (triton-lang/triton#11584), so when
interpreting, bf16 operands are cast to fp32 per tile before any arithmetic (`DOT_DTYPE`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moemesh_kernels.fp8 import FP8_DTYPE, quantize_fp8
from moemesh_kernels.moe_configs import get_config

_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
             FP8_DTYPE: tl.float8e4nv}
_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Routing: softmax + top-k
# ----------------------------------------------------------------------------------------------

@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_lt, stride_wt, stride_it,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """logits [T, E] (fp32/fp16/bf16) -> weights [T, K] fp32, ids [T, K] int32/int64.

    Grid (T,): one program per token row. The row is loaded whole as a BLOCK_E = next_pow2(E) vector
    (padding masked to -inf), softmax runs in fp32, then K rounds of argmax-and-mask pick the experts
    in descending probability. Ties go to the lowest expert index (the min index among the maxima),
    so the result is deterministic; torch.topk usually, but not by contract, does the same.
    """
    t = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    valid = offs_e < E
    logits = tl.load(logits_ptr + t * stride_lt + offs_e, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=0)
    # a row with a NaN (or all -inf) has NaN probabilities: its picks are still experts that exist (the
    # lowest), and its weights NaN, as torch's; NaN never equals the max, so a padding lane would win
    nan_row = tl.max(tl.where(valid & (p != p), 1, 0), axis=0)
    p = tl.where(valid & (p != p), 2.0, p)
    p = tl.where(valid, p, -1.0)  # padding (and, below, picked experts) can never win: p >= 0

    offs_k = tl.arange(0, BLOCK_TOPK)
    top_w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs_e, BLOCK_E), axis=0)  # lowest index among ties
        top_w = tl.where(offs_k == k, best, top_w)
        top_i = tl.where(offs_k == k, idx, top_i)
        p = tl.where(offs_e == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(offs_k < TOP_K, top_w, 0.0), axis=0)
    top_w = tl.where(nan_row > 0, float("nan"), top_w)
    keep = offs_k < TOP_K
    tl.store(weights_ptr + t * stride_wt + offs_k, top_w, mask=keep)
    tl.store(ids_ptr + t * stride_it + offs_k, top_i.to(ids_ptr.dtype.element_ty), mask=keep)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 ids_dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K] float32, ids [T, K] ids_dtype (int32 or int64)).

    Softmax in float32, the top K by probability (ties: lowest expert index), optionally renormalised
    so a token's weights sum to 1. Same contract as `moemesh_kernels.moe_torch.select_experts`."""
    assert router_logits.dim() == 2 and router_logits.dtype in _ACT_DTYPES, (router_logits.shape, router_logits.dtype)
    assert router_logits.stride(1) == 1, "router_logits rows must be contiguous"
    assert ids_dtype in (torch.int32, torch.int64), ids_dtype
    T, E = router_logits.shape
    assert 1 <= top_k <= E, (top_k, E)
    _check_backend(router_logits)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=ids_dtype, device=router_logits.device)
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    _topk_softmax_kernel[(T,)](router_logits, weights, ids, E, router_logits.stride(0), weights.stride(0),
                               ids.stride(0), TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e,
                               BLOCK_TOPK=triton.next_power_of_2(top_k), num_warps=1 if block_e <= 256 else 4)
    return weights, ids


def topk_softmax_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Torch reference of `topk_softmax`: a stable descending sort makes ties go to the lowest index."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# ----------------------------------------------------------------------------------------------
# Block alignment: slots sorted by expert, runs padded to BLOCK_M
# ----------------------------------------------------------------------------------------------

def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """P: the most sorted slots there can be (each non-empty expert wastes < block_m), rounded up to
    block_m. Sized on the host from shapes alone, so aligning needs no device-to-host sync."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, K] (int32/int64; ids outside [0, E) are skipped) ->
    (sorted_token_ids [P] int32, expert_ids [P / block_m] int32, num_tokens_post_padded [1] int32).

    sorted_token_ids: the S = T*K slot indices grouped by expert in expert order (ascending slot
    order within an expert), each expert's run padded with the sentinel S to a multiple of block_m.
    expert_ids[b] is the expert of block b. Experts with no slots get no blocks; skipped slots
    (ids outside [0, E), e.g. experts of another expert-parallel rank) are placed in no block.
    num_tokens_post_padded = the used length of sorted_token_ids; past it, entries are the sentinel and
    expert_ids is -1. P = `max_padded_slots` is fixed by the shapes so that nothing syncs with the
    host (vLLM does this in a small CUDA kernel; vectorised torch on the device is enough here).
    """
    assert topk_ids.dim() == 2 and topk_ids.dtype in (torch.int32, torch.int64), (topk_ids.shape, topk_ids.dtype)
    assert block_m >= 1 and num_experts >= 1, (block_m, num_experts)
    device = topk_ids.device
    S, E = topk_ids.numel(), num_experts
    P = max_padded_slots(S, E, block_m)

    flat = topk_ids.reshape(-1).long()  # [S]
    flat = torch.where((flat >= 0) & (flat < E), flat, E)  # skipped slots -> bucket E, sorted last
    order = torch.argsort(flat, stable=True)  # [S] slot indices in expert order
    counts = torch.zeros(E + 1, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))[:E]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts  # [E] where each expert's run starts in `order`

    sorted_e = flat[order]  # [S]
    kept = sorted_e < E
    sorted_e_kept = sorted_e.clamp(max=E - 1)
    rank = torch.arange(S, device=device) - start[sorted_e_kept]  # position inside the expert's run
    dest = torch.where(kept, padded_start[sorted_e_kept] + rank, P)  # skipped -> scratch index P
    sorted_token_ids = torch.full((P + 1,), S, dtype=torch.int32, device=device)
    sorted_token_ids[dest] = order.to(torch.int32)
    sorted_token_ids = sorted_token_ids[:P]

    total = padded_end[-1:]  # [1]
    block_start = torch.arange(0, P, block_m, device=device)  # [P / block_m]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    expert_ids = torch.where(block_start < total, expert_ids, -1)
    return sorted_token_ids, expert_ids, total.to(torch.int32)


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Plain-Python reference: (sorted slot list, expert per block), both exactly as long as used."""
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        run = [s for s, id_ in enumerate(flat) if id_ == e]
        while len(run) % block_m:
            run.append(sentinel)
        sorted_ids += run
        expert_ids += [e] * (len(run) // block_m)
    return sorted_ids, expert_ids


# ----------------------------------------------------------------------------------------------
# The grouped GEMM
# ----------------------------------------------------------------------------------------------

@triton.jit
def fused_moe_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, topk_weights_ptr,
                     sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
                     N, D, P, num_slots,
                     stride_am, stride_ad, stride_be, stride_bn, stride_bd, stride_cm, stride_cn,
                     A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                     HAS_A_SCALE: tl.constexpr, HAS_B_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """C[s, :] = A[s // A_ROW_DIV, :] @ B[e(s)]^T (* a_scale * b_scale[e]) (* topk_weights[s]).

    a [T, D] (A_ROW_DIV = K: rows gathered per token) or [S, D] (A_ROW_DIV = 1: already per slot),
    fp32/fp16/bf16/fp8; b [E, N, D] (same dtype or fp8), any strides; c [S, N]; a_scale [1] and
    b_scale [E] fp32 per-tensor dequantisation scales; topk_weights [S] fp32;
    sorted_token_ids [P] int32 (sentinel = num_slots = S), expert_ids [P / BLOCK_M] int32,
    num_tokens_post_padded [1] int32 (from `moe_align_block_size` with block_m = BLOCK_M).

    Grid (P / BLOCK_M * cdiv(N, BLOCK_N),), ordered in groups of GROUP_M row-blocks for L2 reuse of B.
    A program takes BLOCK_M sorted slots (all of one expert) x BLOCK_N columns and accumulates in fp32
    over D in BLOCK_K steps; edges (padding slots, N % BLOCK_N, D % BLOCK_K) are masked. Both operands
    are cast to DOT_DTYPE before tl.dot (fp8 weights to the activation dtype; bf16 to fp32 in the
    interpreter). Blocks past num_tokens_post_padded return at once; padding rows are not stored.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(P, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_m
    pid_n = (pid % pids_per_group) // group_m

    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_token_ids_ptr + offs_m)  # [BLOCK_M]
    slot_mask = slots < num_slots
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_d = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_d[None, :] * stride_ad
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_d[:, None] * stride_bd

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, tl.cdiv(D, BLOCK_K)):
        d_left = D - d0 * BLOCK_K
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & (offs_d[None, :] < d_left), other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptrs, mask=(offs_d[:, None] < d_left) & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc)
        a_ptrs += BLOCK_K * stride_ad
        b_ptrs += BLOCK_K * stride_bd

    if HAS_A_SCALE:
        acc = acc * tl.load(a_scale_ptr)
    if HAS_B_SCALE:
        acc = acc * tl.load(b_scale_ptr + expert)
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + slots, mask=slot_mask, other=0.0)  # [BLOCK_M]
        acc = acc * w[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=slot_mask[:, None] & n_mask[None, :])


def fused_moe_gemm(a: torch.Tensor, b: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                   num_tokens_post_padded: torch.Tensor, *, top_k: int, a_per_slot: bool, config: dict,
                   a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None,
                   topk_weights: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The grouped GEMM: a [T, D] (gathered per token) or, with a_per_slot, [S, D]; b [E, N, D] ->
    c [S, N] (out_dtype, default a.dtype) with c[s] = a[row(s)] @ b[e(s)]^T * scales (* topk_weights[s]).

    The sorted/expert ids come from `moe_align_block_size(..., block_m=config["BLOCK_M"])`. Rows of
    slots in no block (skipped experts) are zero. fp8 (float8_e4m3fn) operands need their fp32
    scales: b_scale [E] when b is fp8 (per expert), a_scale [1] when a is fp8 (per tensor)."""
    assert a.dim() == 2 and a.is_contiguous(), "a must be a contiguous [rows, D] matrix"
    assert b.dim() == 3 and (b.stride(-1) == 1 or b.stride(-2) == 1), "each b[e] must be row- or column-major"
    assert a.dtype in _ACT_DTYPES + (FP8_DTYPE,) and b.dtype in (a.dtype, FP8_DTYPE), (a.dtype, b.dtype)
    E, N, D = b.shape
    assert a.shape[1] == D, (a.shape, b.shape)
    num_slots = a.shape[0] if a_per_slot else a.shape[0] * top_k
    assert sorted_token_ids.dtype == expert_ids.dtype == num_tokens_post_padded.dtype == torch.int32
    BLOCK_M, BLOCK_N, BLOCK_K = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    P = sorted_token_ids.numel()
    assert P % BLOCK_M == 0 and expert_ids.numel() == P // BLOCK_M, "align with block_m = config['BLOCK_M']"
    assert min(BLOCK_M, BLOCK_N, BLOCK_K) >= 16, "tl.dot needs blocks of at least 16"
    assert (b.dtype == FP8_DTYPE) == (b_scale is not None), "b_scale [E] goes with (and only with) fp8 b"
    assert (a.dtype == FP8_DTYPE) == (a_scale is not None), "a_scale [1] goes with (and only with) fp8 a"
    if b_scale is not None:
        assert b_scale.shape == (E,) and b_scale.dtype == torch.float32 and b_scale.is_contiguous(), b_scale
    if a_scale is not None:
        assert a_scale.numel() == 1 and a_scale.dtype == torch.float32, a_scale
    if topk_weights is not None:
        assert topk_weights.numel() == num_slots and topk_weights.dtype == torch.float32
        assert topk_weights.is_contiguous()
    out_dtype = out_dtype or a.dtype
    assert out_dtype in _ACT_DTYPES, "give out_dtype when a is fp8"
    _check_backend(a, b, sorted_token_ids)

    c = torch.zeros(num_slots, N, dtype=out_dtype, device=a.device)
    if num_slots == 0:
        return c
    grid = (P // BLOCK_M * triton.cdiv(N, BLOCK_N),)
    fused_moe_kernel[grid](
        a, b, c, a_scale, b_scale, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        N, D, P, num_slots, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1),
        A_ROW_DIV=1 if a_per_slot else top_k, MUL_ROUTED_WEIGHT=topk_weights is not None,
        HAS_A_SCALE=a_scale is not None, HAS_B_SCALE=b_scale is not None, DOT_DTYPE=_dot_dtype(a.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=config.get("GROUP_M", 1),
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2))
    return c


def fused_moe_gemm_ref(a, b, topk_ids, *, top_k, a_per_slot, a_scale=None, b_scale=None, topk_weights=None,
                       out_dtype=None):
    """Slow reference of `fused_moe_gemm`: one slot at a time in fp32 on dequantised operands."""
    E, N, _ = b.shape
    flat = topk_ids.reshape(-1).tolist()
    c = torch.zeros(len(flat), N, dtype=torch.float32)
    for s, e in enumerate(flat):
        if not 0 <= e < E:
            continue
        row = a[s if a_per_slot else s // top_k].float() * (a_scale.item() if a_scale is not None else 1.0)
        w = b[e].float() * (b_scale[e].item() if b_scale is not None else 1.0)
        c[s] = w @ row * (topk_weights.reshape(-1)[s].item() if topk_weights is not None else 1.0)
    return c.to(out_dtype or a.dtype)


# ----------------------------------------------------------------------------------------------
# The whole expert computation
# ----------------------------------------------------------------------------------------------

def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, *, expert_offset: int = 0,
                         w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                         a13_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None,
                         block_config: dict | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_* [T, K] -> [T, H].

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])), e = topk_ids[t, k]
    - expert_offset, as `moemesh_kernels.moe_torch.fused_experts`; slots routed to experts outside this rank's
    [0, E) add nothing. FP8: fp8 w13/w2 need fp32 per-expert scales w13_scale/w2_scale [E]; with
    a13_scale/a2_scale [1] (static per-tensor) the GEMM inputs are quantised to fp8 too (w8a8),
    otherwise the weights are dequantised in the kernel (w8a16). block_config overrides the table
    lookup (`moemesh_kernels.moe_configs.get_config`); one config serves both GEMMs (they share BLOCK_M).
    """
    assert x.dim() == 2 and x.is_contiguous() and x.dtype in _ACT_DTYPES, (x.shape, x.dtype)
    T, H = x.shape
    E, two_I, _ = w13.shape
    I = two_I // 2
    assert w13.shape == (E, 2 * I, H) and w2.shape == (E, H, I), (w13.shape, w2.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == T, (topk_ids.shape, topk_weights.shape)
    assert topk_weights.dtype == torch.float32, topk_weights.dtype
    K = topk_ids.shape[1]
    quantised = w13.dtype == FP8_DTYPE
    assert w2.dtype == w13.dtype and w13.dtype in (x.dtype, FP8_DTYPE), (x.dtype, w13.dtype, w2.dtype)
    dtype_name = ("fp8_w8a8" if a13_scale is not None else "fp8_w8a16") if quantised else _DTYPE_NAME[x.dtype]
    config = block_config or get_config(E, 2 * I, H, dtype_name, _device_name(x.device), T)

    ids = topk_ids - expert_offset if expert_offset else topk_ids
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(ids, E, config["BLOCK_M"])
    align = (sorted_ids, expert_ids, num_post_padded)

    a13 = quantize_fp8(x, a13_scale)[0] if a13_scale is not None else x  # static: saturates at 448 * scale
    h = fused_moe_gemm(a13, w13, *align, top_k=K, a_per_slot=False, config=config, a_scale=a13_scale,
                       b_scale=w13_scale, out_dtype=x.dtype)  # [S, 2I]
    act = F.silu(h[:, :I]) * h[:, I:]  # [S, I]
    a2 = quantize_fp8(act, a2_scale)[0] if a2_scale is not None else act
    y = fused_moe_gemm(a2, w2, *align, top_k=K, a_per_slot=True, config=config, a_scale=a2_scale,
                       b_scale=w2_scale, topk_weights=topk_weights.contiguous(), out_dtype=x.dtype)  # [S, H]
    return y.view(T, K, H).sum(dim=1)


_DTYPE_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"


def _interpreting() -> bool:
    """Whether the kernels were decorated in interpreter mode (TRITON_INTERPRET=1 at import)."""
    return not isinstance(fused_moe_kernel, triton.runtime.JITFunction)


def _dot_dtype(a_dtype: torch.dtype):
    """The dtype both tiles are cast to before tl.dot: the activation dtype (fp8 weights follow it;
    fp8 x fp8 stays fp8), except bf16 under the interpreter, whose bf16 arithmetic is wrong."""
    if a_dtype == torch.bfloat16 and _interpreting():
        return tl.float32
    return _TL_DTYPE[a_dtype]


def _check_backend(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"tensors on several devices: {devices}"
    device = devices.pop()
    if device.type == "cpu" and not _interpreting():
        raise RuntimeError("Triton kernels on CPU tensors run only in the interpreter: set TRITON_INTERPRET=1 "
                           "before moemesh_kernels.fused_moe_triton is imported, or use moemesh_kernels.moe_torch on CPU")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"no Triton backend for {device.type} tensors")
