"""Tuning the fused-MoE block sizes on a GPU: writes the table that `moemesh_kernels.moe_configs` reads.

Legend: E = experts, N x K = the first GEMM of an expert (N = 2I, K = H), M = tokens in the batch.

Kept apart from the table so that the table imports no kernel: this module sits above both
(`moemesh_kernels.fused_moe_triton` looks its blocks up in `moemesh_kernels.moe_configs`; `tune` times the kernels
and writes the table).
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import torch
import triton.testing

from moemesh_kernels.fp8 import FP8_DTYPE, quantize_fp8_per_expert
from moemesh_kernels.fused_moe_triton import fused_experts_triton
from moemesh_kernels.moe_configs import CONFIG_DIR, DTYPE_NAMES, config_file_name, tuned_table


def default_candidates() -> list[dict]:
    """A modest search space for `tune`: 4 * 4 * 3 * 2 * 2 * 2 = 384 configs."""
    grid = itertools.product([16, 32, 64, 128], [32, 64, 128, 256], [64, 128, 256], [1, 16], [4, 8], [3, 4])
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=s)
            for m, n, k, g, w, s in grid]


def tune(E: int, N: int, K: int, dtype_name: str, Ms: list[int], candidates: list[dict] | None = None, *,
         top_k: int = 2, out_dir: Path | str = CONFIG_DIR, seed: int = 0) -> dict[int, dict]:
    """Time every candidate on the whole `fused_experts_triton` for a layer with w13 [E, N, K] and
    w2 [E, K, N/2], for each batch size M in Ms, on the current CUDA device; write the fastest per M
    to out_dir/`config_file_name(...)` and return {M: config}. GPU only (raises RuntimeError on CPU).

    Candidates that fail to compile (e.g. too much shared memory) are skipped. Routing is uniform
    random top-k; real traffic is skewed, so re-tune with recorded router logits if it matters."""
    if not torch.cuda.is_available():
        raise RuntimeError("tune() times kernels with triton.testing.do_bench and needs a CUDA GPU")
    assert dtype_name in DTYPE_NAMES and N % 2 == 0, (dtype_name, N)
    device = torch.device("cuda")
    device_name = torch.cuda.get_device_name(device).replace(" ", "_")
    act_dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(dtype_name, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(E, N, K, device=device, dtype=act_dtype, generator=g) / K ** 0.5
    w2 = torch.randn(E, K, N // 2, device=device, dtype=act_dtype, generator=g) / (N // 2) ** 0.5
    quant = {}
    if dtype_name.startswith("fp8"):
        (w13, quant["w13_scale"]), (w2, quant["w2_scale"]) = quantize_fp8_per_expert(w13), quantize_fp8_per_expert(w2)
        assert w13.dtype == FP8_DTYPE
        if dtype_name == "fp8_w8a8":
            quant["a13_scale"] = quant["a2_scale"] = torch.full((1,), 0.01, device=device)

    best: dict[int, dict] = {}
    for M in Ms:
        x = torch.randn(M, K, device=device, dtype=act_dtype, generator=g)
        logits = torch.randn(M, E, device=device, generator=g)
        weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
        timings = []
        for config in candidates or default_candidates():
            run = functools.partial(fused_experts_triton, x, w13, w2, weights, ids, block_config=config, **quant)
            try:
                run()
                timings.append((triton.testing.do_bench(run, warmup=10, rep=50), config))
            except Exception:  # noqa: BLE001 - a candidate that cannot compile or launch is just not a candidate
                continue
        if not timings:
            raise RuntimeError(f"no candidate config ran for M={M}")
        best[M] = min(timings, key=lambda tc: tc[0])[1]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / config_file_name(E, N, K, dtype_name, device_name)).write_text(
        json.dumps({str(m): c for m, c in sorted(best.items())}, indent=2) + "\n")
    tuned_table.cache_clear()
    return best
