"""The native CPU kernels (kernels/csrc/cpu_gemm.c) against torch references: the packed GEMM in
float32, bfloat16 and int8 over awkward shapes, the fused MoE with expert parallelism, threads, the
build cache and its fallback, and whole models on the native backend (greedy parity with the torch
backend and transformers is in test_model_parity, which runs native by default on CPU)."""

from __future__ import annotations

import math
import os
import random
import types

import pytest
import torch
import torch.nn.functional as F

from moemesh_kernels import cpu_gemm
from moemesh_kernels.backend import BackendError, resolve_backend
from moemesh_kernels.moe_torch import fused_experts, select_experts
from reference_moe import reference_moe

lib = cpu_gemm.native()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the native kernels cannot be built here")

WEIGHT_TYPES = [torch.float32, torch.bfloat16, torch.int8]


def test_pack_round_trips():
    w = torch.randn(37, 29)
    panels = -(-37 // lib.panel_width)
    for wt, pairs in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        p = cpu_gemm.pack(w, lib.panel_width, wt, pairs=pairs)
        assert p.pairs == pairs
        assert p.data.shape == (panels, 29, lib.panel_width)  # (pairs: the same shape, rows k and k + 1 paired)
        torch.testing.assert_close(p.unpack(), w.to(wt).float(), rtol=0, atol=0)
    assert cpu_gemm.pack(w, lib.panel_width, torch.bfloat16).pairs == lib.bf16_pairs  # as the kernels read them
    q = cpu_gemm.pack(w, lib.panel_width, torch.int8)
    assert q.data.dtype == torch.int8 and q.scale.shape == (q.data.shape[0] * lib.panel_width,)
    # per-row symmetric int8: each element within half a step of its row's scale
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.unpack() - w).abs() <= step / 2 + 1e-7).all()


def test_every_prefetch_policy_gives_the_same_bits(monkeypatch, tmp_path):
    """The prefetch policy (`prefetch_policy`, timed once per machine) moves when weights reach the
    caches, never what is computed: products of every row count up to two tiles, and the experts,
    are bit for bit the same under each. MOEMESH_PREFETCH sets it by hand; a kept choice is read back."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3 * lib.panel_width + 5, 300, generator=g)
    x = torch.randn(2 * lib.tile_rows + 1, 300, generator=g)
    E, H, I = 4, 64, 96
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    xm = torch.randn(9, H, generator=g)
    ids = torch.randint(0, E, (9, 2), generator=g)
    weights = torch.rand(9, 2, generator=g)
    runs = []
    try:
        for policy in cpu_gemm.PREFETCH_POLICIES:
            lib.lib.mm_set_prefetch(*policy)
            out = []
            for wt in WEIGHT_TYPES:
                p = cpu_gemm.pack(w, lib.panel_width, wt)
                out += [cpu_gemm.gemm(x[:m], p, lib) for m in range(1, len(x) + 1)]
                out.append(cpu_gemm.fused_moe(xm, cpu_gemm.pack(w13, lib.panel_width, wt),
                                              cpu_gemm.pack(w2, lib.panel_width, wt), weights, ids, 0, lib))
            runs.append(out)
    finally:
        lib.lib.mm_set_prefetch(*lib.prefetch)
    for out in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out, runs[0]))
    monkeypatch.setenv("MOEMESH_PREFETCH", "0,5")
    assert cpu_gemm.prefetch_policy(lib) == (0, 5)
    monkeypatch.delenv("MOEMESH_PREFETCH")
    # a choice kept beside the library is read back, not measured again (no library to measure with here)
    kept_dir = tmp_path / "kernels"
    kept_dir.mkdir()
    (kept_dir / "lib.so.prefetch").write_text("0,4\n")
    assert cpu_gemm.prefetch_policy(types.SimpleNamespace(path=kept_dir / "lib.so", lib=None)) == (0, 4)


@pytest.mark.parametrize("wt", WEIGHT_TYPES, ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_gemm_matches_torch(wt, seed):
    rng = random.Random(seed)
    # rows across every tile size and past the row block; columns off the panel width; odd K, K > one chunk
    M = rng.choice([1, 2, 3, 5, lib.tile_rows, lib.tile_rows + 1, 13, 97, 130])
    N = rng.choice([1, 7, lib.panel_width, 3 * lib.panel_width + 5, 100])
    K = rng.choice([1, 9, 64, 77, 600, 1100])
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    p = cpu_gemm.pack(w, lib.panel_width, wt)
    got = cpu_gemm.gemm(x, p, lib)
    # paired bfloat16 multiplies the activations rounded to bfloat16 (vdpbf16ps), exactly
    want = _seen(x, p).double() @ p.unpack().double().T
    assert got.shape == (M, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)


@pytest.mark.parametrize("K", [6, 7])
def test_paired_panels_hold_k_and_k_plus_1_side_by_side(K):
    """The paired layout cpu_gemm.c reads (BF16_PAIRS): row 2j + h of a panel holds columns 16h ..
    16h + 15 of k = 2j and 2j + 1, pair after pair; an odd K's last row stays in column order."""
    NR = 32
    w = torch.randn(2 * NR, K, generator=torch.Generator().manual_seed(K)).bfloat16()
    p = cpu_gemm.pack(w, NR, torch.bfloat16, pairs=True)
    for panel in range(2):
        for j in range(K // 2):
            for h in range(2):
                for c in range(NR // 2):
                    for t in range(2):
                        assert p.data[panel, 2 * j + h, 2 * c + t] == w[panel * NR + 16 * h + c, 2 * j + t]
        if K % 2:
            assert torch.equal(p.data[panel, K - 1], w[panel * NR:(panel + 1) * NR, K - 1])
    assert torch.equal(cpu_gemm.unpair_panels(p.data), w.reshape(2, NR, K).transpose(1, 2))


@pytest.mark.parametrize("M,K", [(4, 600), (13, 600), (13, 1031), (97, 77), (130, 1025), (40, 4133), (16, 4133)])
def test_bfloat16_gemm_across_chunks_and_row_blocks(M, K):
    """bfloat16 products with more rows than a register tile and K past the 512-k chunk (odd K too),
    past the 4096-k chunk of AMX tiles that several blocks of 16 rows share (one block takes all of
    K), and past the 96-row block: where the paired kernels step through their activation pairs."""
    g = torch.Generator().manual_seed(M * K)
    x, w = torch.randn(M, K, generator=g), torch.randn(3 * lib.panel_width + 5, K, generator=g)
    p = cpu_gemm.pack(w, lib.panel_width, torch.bfloat16)
    want = _seen(x, p).double() @ p.unpack().double().T
    torch.testing.assert_close(cpu_gemm.gemm(x, p, lib).double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)


def test_a_bfloat16_weight_packed_for_the_other_kernels_is_refused():
    w = torch.randn(40, 24)
    other = cpu_gemm.pack(w, lib.panel_width, torch.bfloat16, pairs=not lib.bf16_pairs)
    with pytest.raises(ValueError, match="bfloat16 weight packed"):
        cpu_gemm.gemm(torch.randn(5, 24), other, lib)
    with pytest.raises(ValueError, match="bfloat16 weight packed"):
        cpu_gemm.weight_desc(other)
    w13 = cpu_gemm.pack(torch.randn(2, 16, 24), lib.panel_width, torch.bfloat16, pairs=not lib.bf16_pairs)
    w2 = cpu_gemm.pack(torch.randn(2, 24, 8), lib.panel_width, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 weight packed"):
        cpu_gemm.fused_moe(torch.randn(3, 24), w13, w2, torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), 0, lib)


def _seen(x: torch.Tensor, p: cpu_gemm.PackedWeight, rows: int | None = None) -> torch.Tensor:
    """The activations a product of `rows` rows (default: x's) with `p` multiplies: paired bfloat16
    rounds them to bfloat16 (vdpbf16ps), unless the product has a few rows."""
    rows = x.shape[0] if rows is None else rows
    return x.bfloat16().float() if p.pairs and p.data.dtype == torch.bfloat16 and rows > lib.few_rows else x


def test_gemm_reads_strided_rows_and_any_input_dtype():
    x = torch.randn(6, 40)[:, :32]  # rows 40 apart
    w = torch.randn(20, 32)
    p = cpu_gemm.pack(w, lib.panel_width)
    torch.testing.assert_close(cpu_gemm.gemm(x, p, lib), x @ w.T, rtol=1e-5, atol=1e-5)
    xb, bias = x.bfloat16(), torch.randn(20).bfloat16()
    y = cpu_gemm.linear(xb.view(2, 3, 32), p, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 20)
    torch.testing.assert_close(y.float(), (xb.float() @ w.T + bias.float()).view(2, 3, 20), rtol=2e-2, atol=2e-2)
    assert cpu_gemm.gemm(torch.empty(0, 32), p, lib).shape == (0, 20)


def test_threads_split_columns_without_changing_a_bit():
    x, w = torch.randn(33, 300), torch.randn(500, 300)
    p = cpu_gemm.pack(w, lib.panel_width)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.gemm(x, p, lib)
        torch.set_num_threads(2)
        two = cpu_gemm.gemm(x, p, lib)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def moe_case(seed, T, E, K, H, I):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w1, w3, w2 = (torch.randn(E, I, H, generator=g) / H ** 0.5, torch.randn(E, I, H, generator=g) / H ** 0.5,
                  torch.randn(E, H, I, generator=g) / I ** 0.5)
    gate = torch.randn(E, H, generator=g) * 2 / H ** 0.5
    return x, w1, w3, w2, gate


@pytest.mark.parametrize("wt", WEIGHT_TYPES, ids=str)
@pytest.mark.parametrize("seed", range(8))
def test_fused_moe_matches_reference(wt, seed):
    rng = random.Random(100 + seed)
    E = rng.randint(1, 9)
    T, K, H, I = rng.choice([1, 2, 7, 40, 150]), rng.randint(1, min(3, E)), rng.choice([8, 24, 48, 70]), \
        rng.choice([8, 20, 64])
    x, w1, w3, w2, gate = moe_case(seed, T, E, K, H, I)
    probs = torch.softmax(x @ gate.T, dim=-1)
    weights, ids = torch.topk(probs, K, dim=-1)
    p13, p2 = cpu_gemm.pack(torch.cat([w1, w3], dim=1), lib.panel_width, wt), cpu_gemm.pack(w2, lib.panel_width, wt)
    got = cpu_gemm.fused_moe(x, p13, p2, weights, ids, 0, lib)
    w13q, w2q = p13.unpack(), p2.unpack()  # the weights the kernel multiplies by (bf16 / int8 rounded)
    rows = torch.bincount(ids.flatten(), minlength=E)  # (an expert's rows decide how its products multiply)
    seen = lambda v, e: _seen(v.float().unsqueeze(0), p13, int(rows[e]))[0].double()  # noqa: E731
    want = reference_moe(x.double(), gate.double(), w13q[:, :I].double(), w13q[:, I:].double(), w2q.double(), K,
                         renormalize=False, expert_input=seen)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T,E,H,I", [(40, 2, 515, 33), (24, 3, 70, 601), (9, 1, 1031, 17)])
def test_bfloat16_fused_moe_odd_and_long_rows(T, E, H, I):
    """Experts of more and fewer rows than a few, odd H and I, H and I past the 512-k chunk."""
    x, w1, w3, w2, gate = moe_case(T + E, T, E, 1, H, I)
    weights, ids = torch.topk(torch.softmax(x @ gate.T, dim=-1), 1, dim=-1)
    p13 = cpu_gemm.pack(torch.cat([w1, w3], dim=1), lib.panel_width, torch.bfloat16)
    p2 = cpu_gemm.pack(w2, lib.panel_width, torch.bfloat16)
    got = cpu_gemm.fused_moe(x, p13, p2, weights, ids, 0, lib)
    w13q, w2q = p13.unpack(), p2.unpack()
    rows = torch.bincount(ids.flatten(), minlength=E)
    seen = lambda v, e: _seen(v.float().unsqueeze(0), p13, int(rows[e]))[0].double()  # noqa: E731
    want = reference_moe(x.double(), gate.double(), w13q[:, :I].double(), w13q[:, I:].double(), w2q.double(), 1,
                         renormalize=False, expert_input=seen)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(lib is None or not lib.amx, reason="no AMX tiles here (or MOEMESH_AMX=0)")
@pytest.mark.parametrize("M,K", [(8, 77), (16, 512), (15, 1031), (97, 600), (130, 1100)])
def test_amx_tiles_give_the_paired_products_sums(M, K):
    """Products of bfloat16 weights with lib.amx rows or more go through AMX tiles (cpu_gemm.c
    `panel_rows_amx`): the sums of the activations rounded to bfloat16, as the vdpbf16ps tiles give
    them (within float32 rounding: the order differs), for a gemm and for a fused MoE (its experts
    get 4 rows at M = 8 and 7-65 in the others: the tiles from lib.amx rows, vdpbf16ps below); from
    fewer rows the two paths are one."""
    g = torch.Generator().manual_seed(M + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(3 * lib.panel_width + 5, K, generator=g)
    p = cpu_gemm.pack(w, lib.panel_width, torch.bfloat16)
    want = _seen(x, p).double() @ p.unpack().double().T
    x13, w1, w3, w2, gate = moe_case(M + K, M, 4, 2, K, 40)
    weights, ids = torch.topk(torch.softmax(x13 @ gate.T, dim=-1), 2, dim=-1)
    p13 = cpu_gemm.pack(torch.cat([w1, w3], dim=1), lib.panel_width, torch.bfloat16)
    p2 = cpu_gemm.pack(w2, lib.panel_width, torch.bfloat16)
    try:
        tiles = cpu_gemm.gemm(x, p, lib)
        moe_tiles = cpu_gemm.fused_moe(x13, p13, p2, weights, ids, 0, lib)
        lib.lib.mm_set_amx(0)
        plain = cpu_gemm.gemm(x, p, lib)
        moe_plain = cpu_gemm.fused_moe(x13, p13, p2, weights, ids, 0, lib)
    finally:
        lib.lib.mm_set_amx(lib.amx)
    torch.testing.assert_close(tiles.double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)
    torch.testing.assert_close(tiles, plain, rtol=1e-5, atol=1e-5 * K ** 0.5)
    # (the experts' activations are rounded to bfloat16 between their two products: where the order
    # of a sum moves one across a rounding boundary, its term in the second product moves by 2^-8)
    torch.testing.assert_close(moe_tiles, moe_plain, rtol=5e-3, atol=5e-4)
    if min(M, 96) < lib.amx:  # (a gemm's rows go in blocks of 96)
        assert torch.equal(tiles, plain)


def _int8_bound_case(seed: int, M: int, K: int) -> tuple[torch.Tensor, cpu_gemm.PackedWeight]:
    """M rows of K activations (row 0 zeros, row 1 with an outlier 10^4 times its neighbours, row 2
    at 10^-37) and an int8 weight of 3 panels and 5 columns whose last k is zero in every column and
    whose k = 1 alternates in sign over the first two panels' columns (`_put_infinities` meets
    them)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(3 * lib.panel_width + 5, K, generator=g)
    x[0] = 0.0
    x[1, K // 2] = 1e4
    x[2] *= 1e-37
    w[:, -1] = 0.0  # (a zero weight in every column, where the infinities below meet it)
    w[: 2 * lib.panel_width, 1] = torch.where(torch.arange(2 * lib.panel_width) % 2 == 0, 1.0, -1.0)
    return x, cpu_gemm.pack(w, lib.panel_width, torch.int8)


def _put_infinities(x: torch.Tensor, rows: tuple[int, int, int, int, int]) -> None:
    """Rows of x (K wide) given, in order: an infinity; a NaN; two infinities, one meeting the zero
    weights of the last k (NaN everywhere); two meeting k = 1's weights of both signs (NaN in half
    the columns); a -inf at the last k only (a zero weight, NaN), as `_int8_bound_case` lays out."""
    K = x.shape[1]
    x[rows[0], 0] = float("inf")
    x[rows[1], 1] = float("nan")
    x[rows[2], [0, K - 1]] = float("inf")
    x[rows[3], [0, 1]] = float("inf")
    x[rows[4], K - 1] = -float("inf")


@pytest.mark.skipif(lib is None or not lib.amx, reason="no AMX tiles here (or MOEMESH_AMX=0)")
@pytest.mark.parametrize("M,K,I", [(12, 200, 40), (15, 64, 40), (16, 512, 33), (33, 1031, 520), (97, 600, 40),
                                   (130, 1100, 519)])
def test_amx_tiles_take_int8_weights_within_their_bound(M, K, I):
    """Products of int8 weights with lib.amx_i8_rows rows or more (and lib.amx) go through AMX-INT8
    tiles, each activation row as three int8 parts under one scale (cpu_gemm.c `quant_row`): within
    2^-21 of max|x| times the sum of |w| of the exact product (float64 over the dequantized
    weights; the parts hold x within 2^-23 max|x|, the rest is float32 rounding), and within the
    register tiles' 2^-16 of the sum of |x w| on rows without outliers, for a gemm and for a fused
    MoE whose experts get 6-65 rows (an intermediate size odd, or above the 512-k chunk); from fewer
    rows the two paths are one. A row with an outlier 10^4 times its neighbours keeps the first
    bound, and so does one whose largest element is 10^-37 (scaled by 2^100 on the way); rows with
    infinities (over every chunk of K: one; two meeting a zero weight; two of one sign meeting
    weights of both) give what float32 sums give, a NaN makes its row NaN, a row of zeros zeros."""
    x, p = _int8_bound_case(M * K, M, K)
    wq = p.unpack().double()
    want = x.double() @ wq.T
    bound = (x.double().abs() @ wq.abs().T) * 2.0 ** -16 + 1e-6
    bound[1] = float("inf")  # (the outlier's row: the first bound alone)
    bound[2] = float("inf")  # (and the tiny row's, whose float32 sums reach denormals)
    parts_bound = x.double().abs().amax(dim=1, keepdim=True) * wq.abs().sum(dim=1) * 2.0 ** -21
    x13, w1, w3, w2, gate = moe_case(M + K, M, 4, 2, K, I)
    weights, ids = torch.topk(torch.softmax(x13 @ gate.T, dim=-1), 2, dim=-1)
    p13 = cpu_gemm.pack(torch.cat([w1, w3], dim=1), lib.panel_width, torch.int8)
    p2 = cpu_gemm.pack(w2, lib.panel_width, torch.int8)
    inf = x.clone()
    _put_infinities(inf, (-1, -2, -3, -4, -5))
    try:
        tiles = cpu_gemm.gemm(x, p, lib)
        inf_tiles = cpu_gemm.gemm(inf, p, lib)
        moe_tiles = cpu_gemm.fused_moe(x13, p13, p2, weights, ids, 0, lib)
        lib.lib.mm_set_amx(0)
        plain = cpu_gemm.gemm(x, p, lib)
        inf_plain = cpu_gemm.gemm(inf, p, lib)
        moe_plain = cpu_gemm.fused_moe(x13, p13, p2, weights, ids, 0, lib)
    finally:
        lib.lib.mm_set_amx(lib.amx)
    assert ((tiles.double() - want).abs() <= bound).all()
    assert ((tiles.double() - want).abs() <= parts_bound).all()
    assert ((plain.double() - want).abs() <= bound).all()
    assert (tiles[0] == 0).all() and (plain[0] == 0).all()
    assert inf_tiles[-1].isinf().any() and inf_tiles[-4].isnan().any() and inf_tiles[-4].isinf().any()
    for r in (-1, -2, -3, -4, -5):  # (the same infinities, signs and NaNs as float32 sums)
        assert torch.equal(inf_tiles[r].isnan(), inf_plain[r].isnan()), r
        assert torch.equal(inf_tiles[r].nan_to_num(0.0, 1.0, -1.0), inf_plain[r].nan_to_num(0.0, 1.0, -1.0)) \
            or not inf_plain[r].isinf().any(), r
    assert inf_tiles[-2].isnan().all() and inf_tiles[-3].isnan().all() and inf_tiles[-5].isnan().all()
    torch.testing.assert_close(moe_tiles, moe_plain, rtol=1e-3, atol=1e-3)
    if p.pairs:  # int8 quads: without the tiles, the same parts' exact sums through AVX512-VNNI
        assert ((plain.double() - want).abs() <= parts_bound).all()
        if K <= 512:  # (one chunk of k either way: the same int32 sums, the same epilogue)
            assert torch.equal(tiles, plain)
        return
    takes = max(lib.amx, lib.amx_i8_rows)  # (a gemm's rows go in blocks of 96, an expert's too)
    assert torch.equal(tiles, plain) == (min(M, 96) < takes)
    most = int(torch.bincount(ids.flatten()).max())
    # (the tiles ran where an expert's block reaches them: their sums differ in the last bits)
    assert torch.equal(moe_tiles, moe_plain) == (min(most, 96) < takes)


@pytest.mark.skipif(lib is None or not lib.i8_quads,
                    reason="int8 panels in rows here (no AMX-INT8, AVX512-VNNI, or AMX tiles for this process)")
@pytest.mark.parametrize("M,K", [(1, 4), (2, 68), (3, 200), (4, 1028), (7, 600), (9, 1100), (2, 32788)])
def test_vnni_takes_int8_quads_within_their_bound(M, K):
    """Products of int8 quad panels with fewer rows than AMX tiles take (any number with the tiles
    off) go through AVX512-VNNI (cpu_gemm.c `tile_vnni`: the weights' sign bits flipped, 128 times
    each part's sum taken off) on the tiles' int8 parts of each row: within 2^-21 max|x| sum|w| of
    the exact product, and within 2^-16 of sum|x w| on rows without outliers; rows of 1-4, blocks of
    8 rows a column half at a time, K past one chunk of VNNI_KC. Rows with infinities give what
    float32 sums give, a NaN makes its row NaN, zeros give zeros; a fused MoE whose experts get 1-4
    rows keeps the bound too."""
    x, p = _int8_bound_case(M + K, max(M, 4), K)
    assert p.pairs and p.weight_type == 3  # (W_I8Q)
    wq = p.unpack().double()
    inf = x[:1].repeat(5, 1)
    _put_infinities(inf, (0, 1, 2, 3, 4))
    rows = torch.cat([x, inf])
    try:
        if M > 4:
            lib.lib.mm_set_amx(0)
        got = torch.cat([cpu_gemm.gemm(rows[i:i + M], p, lib) for i in range(0, len(rows), M)])
    finally:
        lib.lib.mm_set_amx(lib.amx)
    n = len(x)
    want = x.double() @ wq.T
    err = (got[:n].double() - want).abs()
    assert (err <= x.double().abs().amax(dim=1, keepdim=True) * wq.abs().sum(dim=1) * 2.0 ** -21).all()
    plain = torch.ones(n, dtype=torch.bool)
    plain[1:3] = False  # (the outlier's row, and the tiny one's, whose float32 sums reach denormals)
    assert (err[plain] <= (x.double().abs() @ wq.abs().T)[plain] * 2.0 ** -16 + 1e-6).all()
    assert (got[0] == 0).all()
    ref = inf @ wq.float().T  # (float32 sums' infinities and NaNs)
    assert torch.equal(got[n:].isnan(), ref.isnan())
    assert torch.equal(got[n:].nan_to_num(0.0, 1.0, -1.0).sign() * ref.isinf(), ref.nan_to_num(0.0, 1.0, -1.0).sign() *
                       ref.isinf())
    assert got[n + 1].isnan().all() and got[n + 2].isnan().all() and got[n + 4].isnan().all()
    if K > 1100:
        return
    x13, w1, w3, w2, gate = moe_case(M + K, 4 * M, 4, 2, K, 36)
    weights, ids = torch.topk(torch.softmax(x13 @ gate.T, dim=-1), 2, dim=-1)
    p13 = cpu_gemm.pack(torch.cat([w1, w3], dim=1), lib.panel_width, torch.int8)
    p2 = cpu_gemm.pack(w2, lib.panel_width, torch.int8)
    got = cpu_gemm.fused_moe(x13, p13, p2, weights, ids, 0, lib)
    w13q, w2q = p13.unpack(), p2.unpack()
    want = reference_moe(x13.double(), gate.double(), w13q[:, :36].double(), w13q[:, 36:].double(), w2q.double(), 2,
                         renormalize=False)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_fused_moe_expert_parallel_halves_add_up():
    """Two ranks holding experts 0-3 and 4-7: their outputs sum to the whole; rows routed elsewhere
    are skipped."""
    x, w1, w3, w2, gate = moe_case(7, 30, 8, 2, 32, 24)
    weights, ids = torch.topk(torch.softmax(x @ gate.T, dim=-1), 2, dim=-1)
    w13 = torch.cat([w1, w3], dim=1)
    whole = cpu_gemm.fused_moe(x, cpu_gemm.pack(w13, lib.panel_width), cpu_gemm.pack(w2, lib.panel_width),
                               weights, ids, 0, lib)
    halves = [cpu_gemm.fused_moe(x, cpu_gemm.pack(w13[r * 4:(r + 1) * 4], lib.panel_width),
                                 cpu_gemm.pack(w2[r * 4:(r + 1) * 4], lib.panel_width), weights, ids, r * 4, lib)
              for r in range(2)]
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole, fused_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)
    # a rank whose experts nobody picked returns zeros
    none = cpu_gemm.fused_moe(x, cpu_gemm.pack(w13[:1], lib.panel_width), cpu_gemm.pack(w2[:1], lib.panel_width),
                              weights, ids, 100, lib)
    assert torch.equal(none, torch.zeros_like(none))


def test_silu_of_extreme_values_is_finite():
    """The kernel's vectorised exp saturates instead of overflowing: silu(-1000) = 0, silu(1000) = 1000."""
    H = I = 16
    x = torch.zeros(1, H)
    w13 = torch.zeros(1, 2 * I, H)
    w13[0, :I, 0] = torch.tensor([-1000.0, 1000.0, -50.0, 50.0] * 4)  # gate = these values (x[0] = 1)
    w13[0, I:, 0] = 1.0  # up = 1
    w2 = torch.eye(H, I).unsqueeze(0)
    x[0, 0] = 1.0
    out = cpu_gemm.fused_moe(x, cpu_gemm.pack(w13, lib.panel_width), cpu_gemm.pack(w2, lib.panel_width),
                             torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), 0, lib)
    torch.testing.assert_close(out[0], F.silu(w13[0, :I, 0]), rtol=1e-6, atol=1e-6)


def test_build_is_cached_and_a_missing_compiler_is_an_error(tmp_path, monkeypatch):
    first = cpu_gemm.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_gemm.build(tmp_path) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(RuntimeError, match="does not run"):
        cpu_gemm.build(tmp_path / "other")


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == "native"
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("auto", "cuda") == "triton"
    with pytest.raises(BackendError, match="CPU only"):
        resolve_backend("native", "cuda")
    with pytest.raises(BackendError, match="not one of"):
        resolve_backend("fast", "cpu")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("h,kvh,D", [(8, 2, 64), (16, 4, 128), (8, 8, 128), (16, 8, 64), (12, 2, 128), (16, 2, 64),
                                     (24, 2, 64), (10, 2, 128), (4, 4, 24), (6, 1, 20), (3, 3, 19), (18, 1, 24)])
def test_decode_attention_matches_sdpa(kv_dtype, h, kvh, D):
    """Every specialised shape (head sizes 64 and 128 with 1, 2, 4, 6 or 8 heads per kv head, and
    more than 8 in groups of 8) and the general code (other sizes and counts)."""
    g = torch.Generator().manual_seed(h * 100 + D)
    block_size, num_blocks = 4, 48
    k_cache = torch.randn(num_blocks, block_size, kvh, D, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, D, generator=g).to(kv_dtype)
    kv_len = torch.tensor([1, 5, 17, 33, 8])
    tables = torch.randperm(num_blocks, generator=g)[:5 * 9].view(5, 9)  # scattered blocks per sequence
    q = torch.randn(5, h, D, generator=g)
    got = cpu_gemm.decode_attention(q, k_cache, v_cache, tables, kv_len, D ** -0.5, lib)
    for s in range(5):
        L = int(kv_len[s])
        keys = k_cache[tables[s]].reshape(-1, kvh, D)[:L].float()  # [L, kvh, D]
        values = v_cache[tables[s]].reshape(-1, kvh, D)[:L].float()
        want = F.scaled_dot_product_attention(q[s].unsqueeze(1), keys.transpose(0, 1), values.transpose(0, 1),
                                              enable_gqa=True).squeeze(1)  # [h, D]
        torch.testing.assert_close(got[s], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 128, 40])
def test_decode_attention_over_many_blocks_with_a_rising_maximum(kv_dtype, D):
    """One pass with a running softmax (kernels/csrc/cpu_gemm.c mm_decode_attention): long contexts
    of 16-key blocks in scattered order, scores over a wide range whose maximum rises block after
    block (each raise rescales what was summed before), a last block cut short; against SDPA."""
    g = torch.Generator().manual_seed(D)
    h, kvh, block_size, num_blocks = 8, 2, 16, 80
    k_cache = torch.randn(num_blocks, block_size, kvh, D, generator=g)
    ramp = torch.linspace(0, 3, num_blocks * block_size).view(num_blocks, block_size, 1, 1)
    k_cache = (k_cache + ramp).to(kv_dtype)  # (keys drift toward q: later blocks score higher)
    v_cache = torch.randn(num_blocks, block_size, kvh, D, generator=g).to(kv_dtype)
    kv_len = torch.tensor([300, 1, 16, 17, 640])
    tables = torch.stack([torch.arange(40) if s == 4 else torch.randperm(num_blocks, generator=g)[:40]
                          for s in range(5)])
    q = torch.ones(5, h, D) + 0.1 * torch.randn(5, h, D, generator=g)
    got = cpu_gemm.decode_attention(q, k_cache, v_cache, tables, kv_len, 2 * D ** -0.5, lib)
    for s in range(5):
        L = int(kv_len[s])
        keys = k_cache[tables[s]].reshape(-1, kvh, D)[:L].double()
        values = v_cache[tables[s]].reshape(-1, kvh, D)[:L].double()
        # (against float64: SDPA's float32 errs here by as much as the kernel does, and the two add up)
        want = F.scaled_dot_product_attention(q[s].unsqueeze(1).double(), keys.transpose(0, 1),
                                              values.transpose(0, 1), scale=2 * D ** -0.5, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(got[s].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("S,h,kvh,threads", [(1, 8, 2, 2), (1, 6, 3, 2), (1, 8, 8, 3), (2, 8, 4, 3), (3, 4, 1, 4),
                                               (5, 8, 2, 2), (9, 8, 2, 2)])
def test_decode_attention_threads_split_sequences_and_kv_heads_without_changing_a_bit(S, h, kvh, threads, kv_dtype):
    """Few sequences for the threads: each sequence's kv heads are split into parts (items of one
    sequence and a part of its heads); every split gives one thread's bits."""
    g = torch.Generator().manual_seed(S * 1000 + h * 10 + kvh)
    D, block_size, num_blocks = 20, 4, 96
    k_cache = torch.randn(num_blocks, block_size, kvh, D, generator=g).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, D, generator=g).to(kv_dtype)
    kv_len = torch.tensor([9, 30, 1, 17, 12, 4, 5, 32, 2][:S])
    tables = torch.randperm(num_blocks, generator=g)[:S * 8].view(S, 8)
    q = torch.randn(S, h, D, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.decode_attention(q, k_cache, v_cache, tables, kv_len, D ** -0.5, lib)
        torch.set_num_threads(threads)
        many = cpu_gemm.decode_attention(q, k_cache, v_cache, tables, kv_len, D ** -0.5, lib)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, many)
    for s in range(S):
        L = int(kv_len[s])
        keys = k_cache[tables[s]].reshape(-1, kvh, D)[:L].float()
        values = v_cache[tables[s]].reshape(-1, kvh, D)[:L].float()
        want = F.scaled_dot_product_attention(q[s].unsqueeze(1), keys.transpose(0, 1), values.transpose(0, 1),
                                              scale=D ** -0.5, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(many[s], want, rtol=1e-5, atol=1e-5)


def test_models_on_cpu_resolve_to_native_everywhere(tmp_path):
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
    from stage_worker.layers.attention import PagedAttention
    from stage_worker.loader import load_model

    write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=1, hidden_size=32, intermediate_size=48,
                                   num_experts=4, vocab_size=384), tmp_path)
    model, _ = load_model(tmp_path, progress=False)
    assert model.backend == "native" and model.lm_head.packed is not None
    assert all(m.backend == "native" for m in model.modules() if isinstance(m, PagedAttention))
    assert model.model.layers["0"].mlp.experts.packed is not None


def test_rms_norm_and_rotary_match_torch():
    from moemesh.config import RopeConfig
    from stage_worker.layers.layernorm import RMSNorm
    from stage_worker.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(40, 1e-5)
    norm.weight.data = torch.randn(40, generator=g)
    x = torch.randn(7, 50, generator=g)[:, :40]  # strided rows
    res = torch.randn(7, 40, generator=g)
    want_plain, (want_out, want_res) = norm(x), norm(x, res)
    norm.backend = "native"
    torch.testing.assert_close(norm(x), want_plain, rtol=1e-5, atol=1e-6)
    got_out, got_res = norm(x, res)
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_res, want_res)

    rope = RotaryEmbedding(16, RopeConfig(theta=10000.0), 64)
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=g)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    positions = torch.tensor([0, 3, 9, 63, 1])
    want_q, want_k = rope(positions, q.clone(), k.clone())
    rope.backend = "native"
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_matches_torch(renormalize):
    logits = torch.randn(50, 9, generator=torch.Generator().manual_seed(1)) * 3
    want_w, want_ids = select_experts(logits, 3, renormalize)
    got_w, got_ids = cpu_gemm.topk_softmax(logits, 3, renormalize, lib)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("E,K", [(4, 2), (6, 2), (8, 2), (9, 3), (60, 4), (64, 6), (128, 8), (64, 1), (256, 2), (512, 8)])
def test_tied_router_scores_go_where_torch_topk_puts_them(E, K):
    """Rows full of exact ties (a few distinct logits, bfloat16-rounded ones): the experts chosen are
    torch.topk's over the softmax, as transformers chooses them, in both of torch's algorithms
    (nth_element; partial_sort where K * 64 <= E), and the weights are theirs."""
    if not lib.torch_tie_order:
        pytest.skip("no C++ compiler: ties go to the lower expert (kernels/README.md)")
    g = torch.Generator().manual_seed(E * 100 + K)
    rows = [torch.randint(0, levels, (40, E), generator=g).float() for levels in (1, 2, 3)]
    rows.append(torch.randn(40, E, generator=g).bfloat16().float() * 0.05)  # (bfloat16 logits tie often)
    logits = torch.cat(rows)
    for renormalize in (False, True):
        want_w, want_ids = select_experts(logits, K, renormalize)
        got_w, got_ids = cpu_gemm.topk_softmax(logits, K, renormalize, lib)
        got_ids, order = got_ids.sort(dim=-1)  # (the set decides the output; its order does not)
        want_ids, want_order = want_ids.sort(dim=-1)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w.gather(1, order), want_w.gather(1, want_order), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("E,K", [(2, 1), (8, 2), (128, 8)])
def test_a_router_row_whose_softmax_is_nan_takes_torch_topks_experts(E, K):
    """A NaN logit, a +inf one or a row of -inf make the softmax all NaN: torch.topk ranks E NaNs, and so
    does the kernel (with its C++ part built in)."""
    if not lib.torch_tie_order:
        pytest.skip("no C++ compiler: ties go to the lower expert (kernels/README.md)")
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(E))
    logits[0, E // 2], logits[1, 0], logits[2] = float("nan"), float("inf"), float("-inf")
    want_w, want_ids = select_experts(logits, K, True)
    got_w, got_ids = cpu_gemm.topk_softmax(logits, K, True, lib)
    assert torch.equal(got_ids, want_ids)
    assert got_w[:3].isnan().all() and want_w[:3].isnan().all()


def test_without_a_cxx_compiler_ties_go_to_the_lower_expert(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-cxx"))
    with caplog.at_level("WARNING", logger="moemesh.kernels"):
        plain = cpu_gemm._Lib(cpu_gemm.build(tmp_path))
    assert not plain.torch_tie_order and "no C++ compiler" in caplog.text
    _, ids = cpu_gemm.topk_softmax(torch.zeros(3, 8), 2, False, plain)
    assert ids.tolist() == [[0, 1]] * 3


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "llama"])
def test_fused_decode_layers_equal_the_op_by_op_path(tmp_path, arch):
    """Decode steps through mm_decoder_layers (one call per step) against the model files' op-by-op
    path on the same native kernels: the same tokens, logits within float noise."""
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings
    from moemesh.sampling import SamplingParams
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
    from stage_worker.runner import StepInput

    write_tiny_model(TinyModelSpec(arch=arch, num_layers=3, hidden_size=64, intermediate_size=96, head_dim=24,
                                   moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=6,
                                   vocab_size=384, mlp_only_layers=(1,) if arch == "qwen3_moe" else ()), tmp_path)
    fused = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=64, block_size=4), progress=False)
    plain = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=64, block_size=4), progress=False)
    assert fused.stages[0].runner.fused is not None and fused.stages[0].runner.fused.head is not None
    plain.stages[0].runner.fused = None
    prompts = [[5, 17, 33, 2, 9], [7], list(range(30, 52))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in fused.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    # one decode step of three sequences straight through each runner: logits within float noise
    tables = [[0, 1], [2], [3, 4, 5, 6, 7, 8]]
    logits = []
    for runner in (fused.stages[0].runner, plain.stages[0].runner):
        runner.execute(StepInput(prompts, [0, 0, 0], tables, [True] * 3))
        logits.append(runner.execute(StepInput([[11], [12], [13]], [len(p) for p in prompts], tables, [True] * 3)))
        # a decode step that samples some rows only: the fused layers, then the op-by-op head
        logits.append(runner.execute(StepInput([[14], [15], [16]], [len(p) + 1 for p in prompts], tables,
                                               [True, False, True])))
    assert logits[0].shape == (3, 384) and logits[1].shape == (2, 384)
    torch.testing.assert_close(logits[0], logits[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1], logits[3], rtol=1e-5, atol=1e-5)
    # the fused head (taken when every row samples) against the op-by-op head after the same fused
    # layers: the same float32 values, bit for bit (the step above again, every row sampled: its K/V
    # writes repeat the same values)
    runner, calls = fused.stages[0].runner, []
    head_logits = runner.fused.logits
    runner.fused.logits = lambda *a: calls.append(1) or head_logits(*a)
    step = StepInput([[14], [15], [16]], [len(p) + 1 for p in prompts], tables, [True] * 3)
    with_head = runner.execute(step)
    runner.fused.head, head = None, runner.fused.head
    try:
        assert torch.equal(runner.execute(step), with_head) and calls == [1]
    finally:
        runner.fused.head = head


def test_fused_decode_in_bfloat16_stays_close_to_float32(tmp_path):
    """bfloat16 weights and KV cache, float32 arithmetic between them: decode logits near float32's, for
    one sequence and for six."""
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
    from stage_worker.runner import StepInput

    write_tiny_model(TinyModelSpec(arch="qwen2_moe", num_layers=2, hidden_size=64, moe_intermediate_size=48,
                                   shared_expert_intermediate_size=64, num_experts=4, vocab_size=384), tmp_path)
    prompts = [[5, 17, 33, 2, 9], [7, 3], [40, 41, 42], [8] * 6, [100, 200, 300, 13], [1, 2, 3, 4, 5, 6, 7]]
    logits = []
    for dtype in ("float32", "bfloat16"):
        runner = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=16, dtype=dtype), progress=False) \
            .stages[0].runner
        assert runner.fused is not None
        runner.execute(StepInput(prompts, [0] * 6, [[b] for b in range(6)], [True] * 6))
        one = runner.execute(StepInput([[11]], [5], [[0]], [True]))  # one row
        # six rows: more than a few, so on a CPU with AVX512-BF16 the paired products (vdpbf16ps) run
        six = runner.execute(StepInput([[11]] * 6, [len(p) + (i == 0) for i, p in enumerate(prompts)],
                                       [[b] for b in range(6)], [True] * 6))
        logits.append((one, six))
    for (one32, six32), (one16, six16) in [logits]:
        for a, b in ((one32, one16), (six32, six16)):
            err = ((b - a).abs().max() / a.abs().max()).item()
            assert 0 < err < 0.05


def test_decode_attention_keeps_a_nan_and_refuses_blocks_outside_the_cache():
    k = torch.randn(4, 4, 1, 16)
    v = torch.randn(4, 4, 1, 16)
    k[1, 2, 0, 3] = float("nan")  # key 6 of the sequence below
    v[1, 2, 0, 3] = float("nan")  # its value: read only by a kernel that runs past the context
    q = torch.randn(1, 2, 16)
    out = cpu_gemm.decode_attention(q, k, v, torch.tensor([[0, 1]]), torch.tensor([7]), 0.25, lib)
    assert torch.isnan(out).all()  # as SDPA: a NaN score poisons the softmax, it is not masked away
    out = cpu_gemm.decode_attention(q, k, v, torch.tensor([[0, 1]]), torch.tensor([6]), 0.25, lib)
    assert torch.isfinite(out).all()  # the NaN key is past this context
    # a first block whose scores are all -inf weighs nothing (the running softmax starts at the next)
    k = torch.randn(4, 4, 1, 16)
    k[2] = -float("inf")
    q = torch.rand(1, 2, 16) + 0.5
    out = cpu_gemm.decode_attention(q, k, v, torch.tensor([[2, 0, 3]]), torch.tensor([10]), 0.25, lib)
    keys, values = k[[2, 0, 3]].reshape(-1, 1, 16)[:10], v[[2, 0, 3]].reshape(-1, 1, 16)[:10]
    want = F.scaled_dot_product_attention(q[0].unsqueeze(1), keys.transpose(0, 1), values.transpose(0, 1), scale=0.25,
                                          enable_gqa=True).squeeze(1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="outside the KV cache"):
        cpu_gemm.decode_attention(q, k, v, torch.tensor([[0, 4]]), torch.tensor([6]), 0.25, lib)
    with pytest.raises(ValueError, match="outside the KV cache"):
        cpu_gemm.decode_attention(q, k, v, torch.tensor([[0, 1]]), torch.tensor([9]), 0.25, lib)


def test_fused_decode_refuses_a_step_outside_the_cache(tmp_path):
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
    from stage_worker.runner import StepInput

    write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=1, hidden_size=32, intermediate_size=48,
                                   num_experts=4, vocab_size=384), tmp_path)
    runner = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=4, block_size=4), progress=False) \
        .stages[0].runner
    assert runner.fused is not None
    runner.execute(StepInput([[5, 6, 7]], [0], [[0]], [True]))
    with pytest.raises(ValueError, match="outside"):
        runner.execute(StepInput([[8]], [3], [[9]], [True]))  # block 9 of a 4-block cache
    bad = [  # (query tokens, context lengths, block tables) of decode and mixed steps
        ([[8]], [3], [[-1]]),  # a negative block
        ([[8], [9]], [3, 4], [[0], [7, 1]]),  # a block attention reads (the slot is in the next)
        ([[8]], [-1], [[0]]),  # a negative position
        ([[8]], [2048], [[0] * 513]),  # past the rotary table (and the cache)
        ([[8], [9, 10]], [4, 0], [[5, 0], [1]]),  # a mixed step's decode table
        ([[8], [9, 10]], [3, 0], [[0], [6]]),  # a mixed step's prompt slot
    ]
    for tokens, context, tables in bad:
        with pytest.raises(ValueError, match="outside"):
            runner.execute(StepInput(tokens, context, tables, [True] * len(tokens)))


def test_decode_context_equals_the_general_path():
    """The pure decode step's one-tensor metadata holds what the general path builds for the same
    sequences (its decode group, when a prompt is added to the step)."""
    from stage_worker.context import build_context

    rng = random.Random(0)
    for _ in range(50):
        B, bs = rng.randint(1, 9), rng.choice([1, 4, 16])
        context = [rng.randint(0, 70) for _ in range(B)]
        # tables cover each context and its new token, some with blocks beyond it
        tables = [rng.sample(range(200), -(-(c + 1) // bs) + rng.randint(0, 2)) for c in context]
        fast = build_context([1] * B, context, tables, bs, limits=(200, 100))
        general = build_context([1] * B + [3], context + [0], tables + [[197, 198, 199]], bs)
        assert len(fast.groups) == 1 and general.groups[0].is_decode
        f, g = fast.groups[0], general.groups[0]
        assert torch.equal(fast.positions, general.positions[:B])
        assert torch.equal(fast.slot_mapping, general.slot_mapping[:B])
        for name in ("token_index", "valid", "block_table", "kv_len", "context_len"):
            assert torch.equal(getattr(f, name), getattr(g, name)), name
            assert getattr(f, name).dtype == getattr(g, name).dtype, name
        assert f.is_decode and f.num_keys == g.num_keys
        assert torch.equal(f.mask, g.mask)


def test_without_a_compiler_auto_falls_back_to_torch(tmp_path, monkeypatch):
    """native() None (no C compiler): auto resolves to torch and a model still generates."""
    from moemesh.entrypoints.engine import LLMEngine
    from moemesh.settings import EngineSettings
    from moemesh.sampling import SamplingParams
    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

    write_tiny_model(TinyModelSpec(arch="qwen2_moe", num_layers=2, hidden_size=32, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=32, num_experts=4, vocab_size=384), tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=16), progress=False).generate([[5, 6, 7]], params)
    monkeypatch.setattr(cpu_gemm, "native", lambda: None)
    assert resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(BackendError, match="could not be built"):
        resolve_backend("native", "cpu")
    engine = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=16), progress=False)
    assert engine.stages[0].runner.model.backend == "torch" and engine.stages[0].runner.fused is None
    assert engine.generate([[5, 6, 7]], params)[0].token_ids == want[0].token_ids


def test_topk_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match="top-k 5 of 4"):
        cpu_gemm.topk_softmax(torch.randn(2, 4), 5, False, lib)


def test_argmax_rows_is_torchs_first_maximum():
    x = torch.randn(9, 1000)
    x[2, 10] = x[2, 500] = 100.0  # a tie: the first
    x[3, 7] = float("nan")  # NaN counts as the maximum
    x[4, :] = float("-inf")
    x[5, 0] = float("nan")
    got = cpu_gemm.argmax_rows(x, lib)
    assert torch.equal(got, x.max(dim=-1).indices)
    assert got[2] == 10 and got[3] == 7 and got[4] == 0 and got[5] == 0
    assert torch.equal(cpu_gemm.argmax_rows(x[:, ::2], lib), x[:, ::2].max(dim=-1).indices)  # strided


@pytest.mark.parametrize("n", [1, 7, 8, 33, 64, 1003, 32000])
def test_argmax_rows_finds_the_first_maximum_wherever_it_lies(n):
    """Every position class of the vector loops: the four-vector chunks, the single vectors after
    them, the scalar tail; ties within a chunk and across chunks; NaN past the maximum."""
    g = torch.Generator().manual_seed(n)
    positions = sorted({0, n // 3, n - 1, max(0, n - 5), min(n - 1, 35)})
    x = torch.randn(3 * len(positions) + 1, n, generator=g)
    for r, p in enumerate(positions):
        x[3 * r, p] = 50.0  # a unique maximum at p
        x[3 * r + 1, p] = x[3 * r + 1, n - 1] = 50.0  # tied with the last: p is the first
        x[3 * r + 2, p] = 50.0
        x[3 * r + 2, n - 1] = float("nan")  # NaN counts as the maximum, wherever it is
    x[-1] = 0.0  # all equal: the first
    got = cpu_gemm.argmax_rows(x, lib)
    assert torch.equal(got, x.max(dim=-1).indices)


def test_native_kernels_that_cannot_be_built_are_a_cli_error_with_the_reason(tmp_path):
    """--moe-backend native where the build fails: one line naming the flag and why, no traceback; the
    kernels a build leaves in a cache are readable by every user (not mkstemp's 0600)."""
    import subprocess
    import sys

    from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

    write_tiny_model(TinyModelSpec(arch="mixtral", num_layers=2, hidden_size=32, intermediate_size=48,
                                   num_experts=4, vocab_size=384), tmp_path / "m")
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for pp in ("1", "2"):  # (in process; and a mesh, refused before any worker starts)
        r = subprocess.run([sys.executable, "-m", "moemesh", "generate", "--model", str(tmp_path / "m"), "--pp", pp,
                            "--moe-backend", "native", "--prompt-ids", "5,6", "--max-tokens", "2"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "moemesh: error: --moe-backend native" in r.stderr and "no-such-cc" in r.stderr, r.stderr
    path = cpu_gemm.build(tmp_path / "fresh")
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o755 & ~umask


def _screen_case(V: int, K: int, seed: int, dtype=torch.float32) -> tuple[cpu_gemm.PackedWeight, torch.Tensor]:
    """A head [V, K] with the hard columns at the front: an exact copy of column 0 (a tie, the lower
    index wins), and columns that differ from column 2 by less than the copy can tell apart (a float32
    head's: their bfloat16 copies are equal, their logits are not; a bfloat16 head's: by one
    bfloat16 step in one weight, below the int8 copy's step)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, K, generator=g) * 0.05
    w[1] = w[0]
    for j in (3, 4, 5):
        w[j] = w[2] * (1 + (j - 2) * 2.0 ** -12)
    if dtype == torch.bfloat16:
        w = w.bfloat16().float()
        for j in (3, 4, 5):
            w[j, j] = w[j, j].bfloat16().view(torch.int16).add(j - 2).view(torch.bfloat16).float()
    return cpu_gemm.pack(w, lib.panel_width, dtype), w


@pytest.mark.parametrize("dtype, product", [(torch.float32, "native"), (torch.float32, "onednn"),
                                            (torch.bfloat16, "int8"), (torch.bfloat16, "onednn"),
                                            (torch.int8, "onednn")])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 13, 64])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("K", [96, 40])
def test_screened_head_picks_the_full_products_first_maximum(rows, seed, dtype, product, K):
    """A float32 head through its bfloat16 copy (multiplied by these kernels or by torch's matmul, whose
    bfloat16 sums the bound also covers), a bfloat16 head through its int8 copy (up to three rows; more
    go to the full product) or through torch's matmul of the head itself (its rows rounded to bfloat16
    where the full product rounds them: more than three), an int8 head through torch's matmul of its
    bfloat16 copy: the token is the full product's first maximum, and the bound holds for every
    column of every row the copy decides (rows of 40 too: below 64, an int8 copy in quads widens the
    radius for its rows' int8 parts)."""
    V = 1003
    packed, w = _screen_case(V, K, seed, dtype)
    screen = cpu_gemm.ScreenedHead(packed, V, lib, product)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(rows, K, generator=g) * torch.rand(rows, 1, generator=g) * 40
    # rows that lean on the hard columns: the tie, the near-equal columns, large and tiny scales
    for r, col in enumerate((0, 2, 3, 5)[:rows]):
        x[r] = w[col] * (1e3 if r % 2 else 1e-3) + 1e-4 * x[r]
    exact = cpu_gemm.gemm(x, packed, lib)
    want = exact.max(dim=-1).indices
    assert torch.equal(screen.tokens(x), want)
    if not screen.screens(rows):
        assert dtype == torch.bfloat16 and rows > 3
        return
    assert (_screened(screen, x) >= 0).all()  # every row decided by the screen, none by the full product
    # the bound the screen rests on holds for every column of every row
    approx = screen.approx(x)
    assert approx.dtype == (torch.bfloat16 if product == "onednn" else torch.float32)
    approx = approx[:, :V].float()
    assert ((approx - exact).abs() <= x.double().norm(dim=1, keepdim=True).float() * screen.radius).all()


def test_torchs_product_of_a_long_rows_copy_stays_within_the_bound():
    """The "onednn" radius assumes torch sums in float32 and rounds to bfloat16 once: rows of 4,096
    (oneDNN's blocks over k, where partial sums in bfloat16 would break it) stay within it on every
    column, and the tokens are the full product's."""
    V, K = 700, 4096
    g = torch.Generator().manual_seed(3)
    w = torch.randn(V, K, generator=g) * 0.02
    packed = cpu_gemm.pack(w, lib.panel_width)
    screen = cpu_gemm.ScreenedHead(packed, V, lib, "onednn")
    x = torch.randn(24, K, generator=g) * torch.rand(24, 1, generator=g) * 5
    exact = cpu_gemm.gemm(x, packed, lib)
    approx = screen.approx(x).float()
    assert ((approx - exact).abs() <= x.double().norm(dim=1, keepdim=True).float() * screen.radius).all()
    assert torch.equal(screen.tokens(x), exact.max(dim=-1).indices)


def test_a_bfloat16_heads_screen_recomputes_candidates_from_the_columns_it_names():
    """The candidates' logits come from the packed bfloat16 head (paired where the kernels pair it):
    a head whose largest logit sits in each lane of a panel in turn, the others a hair below it, so
    that the candidates span the panel and reading a wrong lane picks a wrong token."""
    NR, K = lib.panel_width, 64
    g = torch.Generator().manual_seed(5)
    base = torch.randn(K, generator=g).bfloat16().float()
    for top in range(2 * NR):
        w = base.repeat(2 * NR, 1)
        w[:, 0] -= torch.arange(2 * NR).float() % 7 * 2.0 ** -8 * base[0].abs()  # columns a little apart
        w = w.bfloat16().float()
        w[top, 1] = w[top, 1].bfloat16().view(torch.int16).add(1 if base[1] > 0 else -1).view(torch.bfloat16).float()
        packed = cpu_gemm.pack(w, NR, torch.bfloat16)
        screen = cpu_gemm.ScreenedHead(packed, 2 * NR, lib)  # (every column a candidate: at most 64)
        x = base.unsqueeze(0).clone()
        want = cpu_gemm.gemm(x, packed, lib).max(dim=-1).indices
        got = _screened(screen, x)
        assert got.tolist() == want.tolist() and got[0] >= 0, top


def _screened(screen: cpu_gemm.ScreenedHead, x: torch.Tensor) -> torch.Tensor:
    """mm_screened_argmax alone: each row's token, or -1 where it leaves the row to the full product."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    approx = screen.approx(x)
    lib.lib.mm_screened_argmax(x.shape[0], screen.vocab, x.shape[1], approx.data_ptr(),
                               cpu_gemm.WEIGHT_TYPES[approx.dtype], approx.stride(0),
                               x.data_ptr(), x.stride(0), screen.radius.data_ptr(), screen.wn_max,
                               screen.head.data.data_ptr(), screen.head.weight_type,
                               None if screen.head.scale is None else screen.head.scale.data_ptr(), out.data_ptr(), 1)
    return out


def test_a_bfloat16_heads_copy_is_int8_and_its_radius_the_formulas():
    w = torch.randn(300, 40, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    packed = cpu_gemm.pack(w, lib.panel_width, torch.bfloat16)
    screen = cpu_gemm.ScreenedHead(packed, 290, lib)
    want = cpu_gemm.pack(w, lib.panel_width, torch.int8)
    assert torch.equal(screen.copy.data, want.data) and torch.equal(screen.copy.scale, want.scale)
    assert screen.max_rows == lib.few_rows and screen.screens(lib.few_rows) and not screen.screens(lib.few_rows + 1)
    w64, q64 = w[:290].double(), (want.unpack()[:290].double() / want.scale[:290].double().unsqueeze(1)).round()
    c64 = q64 * want.scale[:290].double().unsqueeze(1)  # (the copy's columns, scale times int8, exactly)
    g = 40 * 2.0 ** -24 / (1 - 40 * 2.0 ** -24)
    # (a copy in quads multiplies the rows' int8 parts: 2^-21 sqrt(K), the larger below K = 64)
    g_copy = max(g + 2.0 ** -24 * (1 + g), 2.0 ** -21 * 40 ** 0.5 if want.pairs else 0.0)
    radius = ((w64 - c64).norm(dim=1) + g_copy * c64.norm(dim=1) + g * w64.norm(dim=1)) * (1 + 2.0 ** -10)
    assert torch.equal(screen.radius, radius.float())


def test_screened_head_copy_and_radius_are_the_packed_heads():
    w = torch.randn(300, 40, generator=torch.Generator().manual_seed(0))
    packed = cpu_gemm.pack(w, lib.panel_width, torch.float32)
    screen = cpu_gemm.ScreenedHead(packed, 290, lib)
    want = cpu_gemm.pack(w, lib.panel_width, torch.bfloat16)
    assert screen.copy.pairs == want.pairs and torch.equal(screen.copy.data, want.data)
    # the radius, built panel by panel, against the formula over the whole head at once
    w64 = w[:290].double()
    r64 = w64.to(torch.bfloat16).double()
    u, g = 2.0 ** -8, 40 * 2.0 ** -24 / (1 - 40 * 2.0 ** -24)
    radius = ((w64 - r64).norm(dim=1) + (u + g * (1 + u)) * r64.norm(dim=1) + g * w64.norm(dim=1)) * (1 + 2.0 ** -10)
    assert torch.equal(screen.radius, radius.float())
    assert screen.wn_max >= w[:290].norm(dim=1).max()
    w[7, 3] = float("nan")  # a NaN weight: no row passes the guard
    assert math.isnan(cpu_gemm.ScreenedHead(cpu_gemm.pack(w, lib.panel_width, torch.float32), 290, lib).wn_max)


def test_screened_head_prunes_a_rising_staircase():
    """Logits that rise column after column: each vector adds a column or two to the candidates, and
    the earlier ones fall below the floor, so the buffer (256) fills and is pruned (2 to 9 times,
    with 16 to 4 floats a vector), and the row is still decided."""
    V, K = 4800, 32
    b = torch.randn(K) * 0.1
    w = b * 1.01 ** torch.arange(V, dtype=torch.float64).unsqueeze(1).float()
    packed = cpu_gemm.pack(w, lib.panel_width, torch.float32)
    screen = cpu_gemm.ScreenedHead(packed, V, lib)
    x = torch.stack([b, -b, b * 3]) / b.norm()
    want = cpu_gemm.gemm(x, packed, lib).max(dim=-1).indices
    assert want.tolist() == [V - 1, 0, V - 1]
    assert torch.equal(_screened(screen, x), want)


def test_screened_head_hands_undecidable_rows_to_the_full_product():
    V, K = 500, 40
    packed, w = _screen_case(V, K, 0)
    screen = cpu_gemm.ScreenedHead(packed, V, lib)
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(1))
    x[0] = 0  # every logit 0: all 500 are candidates, first index
    x[1, 3] = float("nan")  # NaN logits: torch.max's NaN-first rule, as argmax_rows has it
    x[2, 0] = float("inf")  # infinite logits (the first +inf)
    x[3] = w[10] * 50  # logits tied at the maximum in 100 columns: too many to recompute
    w = w.clone()
    w[10:110] = w[10]
    packed = cpu_gemm.pack(w, lib.panel_width, torch.float32)
    screen = cpu_gemm.ScreenedHead(packed, V, lib)
    want = cpu_gemm.argmax_rows(cpu_gemm.gemm(x, packed, lib), lib)
    assert _screened(screen, x)[:4].tolist() == [-1] * 4 and (_screened(screen, x)[4:] >= 0).all()
    assert torch.equal(screen.tokens(x), want)
    assert screen.tokens(x)[0] == 0 and screen.tokens(x)[3] == 10
    assert screen.tokens(torch.empty(0, K)).shape == (0,)


def test_screened_head_leaves_overflowing_rows_and_nan_weights_to_the_full_product():
    # |x| near float32's limit: the bfloat16 product overflows to inf in one column where the float32
    # logit is finite, and the other way round in another (vdpbf16ps adds the pair in its own order)
    # (then the same with the weights 2^20 larger and x 2^20 smaller: |x| alone passes, |x| |w| does not)
    for scale in (1.0, 2.0 ** 20):
        for a in ([-1.0, 4.0], [4.0, -1.0]):
            w = torch.tensor([a, [1.5, 1.6]]) * scale
            packed = cpu_gemm.pack(w, lib.panel_width, torch.float32)
            screen = cpu_gemm.ScreenedHead(packed, 2, lib)
            x = torch.full((4, 2), 1e38 / scale)
            assert (_screened(screen, x) == -1).all()
            assert torch.equal(screen.tokens(x), cpu_gemm.argmax_rows(cpu_gemm.gemm(x, packed, lib)[:, :2], lib))
    w = torch.randn(50, 8)
    w[20, 3] = float("nan")
    packed = cpu_gemm.pack(w, lib.panel_width, torch.float32)
    screen = cpu_gemm.ScreenedHead(packed, 50, lib)
    x = torch.randn(5, 8)
    assert (_screened(screen, x) == -1).all()
    assert torch.equal(screen.tokens(x), torch.full((5,), 20))  # NaN counts as the maximum


def test_screened_head_is_built_only_for_a_float32_bfloat16_or_int8_head_where_it_pays(monkeypatch):
    from stage_worker.layers.parallel import TPGroup
    from stage_worker.layers.vocab import ParallelLMHead

    head = ParallelLMHead(100, 32, TPGroup())
    head.weight.data.normal_()
    # what screen_product times: the fastest way here for a float32 head; the int8 copy for a bfloat16
    # one, and torch's product of it from ONEDNN_MIN_ROWS rows where that is faster
    one = lambda way: [(way, cpu_gemm.ONEDNN_MIN_ROWS if way == "onednn" else 1)]  # noqa: E731
    for dtype, want in ((torch.float32, ([], one("native"), one("onednn"))),
                        (torch.bfloat16, (one("int8"), one("int8") + one("onednn"))),
                        (torch.int8, ([], one("onednn")))):
        choice = cpu_gemm.screen_product(cpu_gemm.pack(head.weight.data, lib.panel_width, dtype), 100, lib)
        assert choice in want, (dtype, choice)
        assert cpu_gemm.screen_product(cpu_gemm.pack(head.weight.data, lib.panel_width, dtype), 100, None) == []
    for dtype, choice in ((torch.float32, one("native")), (torch.float32, [("onednn", 16)]), (torch.float32, []),
                          (torch.bfloat16, one("int8")), (torch.bfloat16, []),
                          (torch.int8, [("onednn", 16)]), (torch.int8, []),
                          (torch.bfloat16, [("int8", 1), ("onednn", 16)])):
        monkeypatch.setattr(cpu_gemm, "screen_product", lambda head, vocab, lib, choice=choice: choice)
        head.packed = cpu_gemm.pack(head.weight.data, lib.panel_width, dtype)
        head.screen_packed()
        screens = [] if head.screen is None else getattr(head.screen, "all", [head.screen])
        assert [(s.product, s.min_rows) for s in screens] == choice
    # a bfloat16 head's two screens: the int8 copy up to three rows, torch's product from 16, the full
    # product between; every count gives the full product's tokens
    both = head.screen
    assert isinstance(both, cpu_gemm.HeadScreens)
    assert [getattr(both.pick(r), "product", None) for r in (1, 3, 4, 15, 16, 200)] == \
        ["int8", "int8", None, None, "onednn", "onednn"]
    for rows in (1, 3, 4, 16, 40):
        x = torch.randn(rows, 32)
        assert torch.equal(both.tokens(x), cpu_gemm.gemm(x, head.packed, lib)[:, :100].max(dim=-1).indices)
    # fewer rows than the choice's take the full product, and give its tokens
    screen = cpu_gemm.ScreenedHead(cpu_gemm.pack(head.weight.data, lib.panel_width), 100, lib, "onednn", 8)
    assert not screen.screens(7) and screen.screens(8) and screen.screens(500)
    assert screen.approx(torch.randn(9, 32)).dtype == torch.bfloat16  # (torch's sums, as the radius assumes)
    x = torch.randn(7, 32)
    assert torch.equal(screen.tokens(x), cpu_gemm.gemm(x, screen.head, lib)[:, :100].max(dim=-1).indices)
    head.packed = None
    head.screen_packed()
    assert head.screen is None


def test_a_prefetch_timing_that_runs_out_of_memory_falls_back_to_the_default(monkeypatch, tmp_path):
    """Timing the policy needs about 100 MB of layers: where they cannot be had, the kernels' default
    policy is used and nothing is kept (the next start measures again)."""
    def no_memory(_lib):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(cpu_gemm, "_time_prefetch", no_memory)
    kept = tmp_path / "lib.so.prefetch"
    assert cpu_gemm._measure_prefetch(lib, kept) == cpu_gemm.PREFETCH_POLICIES[0]
    assert not kept.exists()
