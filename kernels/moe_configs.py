"""Block sizes of the fused-MoE Triton kernels, kept as data.

Legend: E = experts (on this rank), N x K = the first GEMM of an expert (N = 2I output rows of w13,
K = H reduction), M = tokens in the batch (T). A config is
{BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages}; one config serves both GEMMs of a layer.

Tuned entries live in `kernels/configs/*.json`, one file per (E, N, K, device, dtype) named by
`config_file_name`, each holding {"M": config} for a few M buckets; `get_config` takes the bucket
nearest to M. Shapes with no file fall back to `default_config`. `tune` writes such files; it needs a
CUDA GPU (Triton's do_bench), and no tuned file has been measured for this project yet.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).with_name("configs")
Key = tuple[int, int, int, str, str]  # (E, N, K, dtype_name, device_name)
DTYPE_NAMES = ("fp32", "fp16", "bf16", "fp8_w8a16", "fp8_w8a8")
_FILE_RE = re.compile(r"E=(\d+),N=(\d+),K=(\d+),device_name=(.+),dtype=(\w+)\.json")


def config_file_name(E: int, N: int, K: int, dtype_name: str, device_name: str) -> str:
    return f"E={E},N={N},K={K},device_name={device_name},dtype={dtype_name}.json"


def load_config_dir(path: Path | str = CONFIG_DIR) -> dict[Key, dict[int, dict]]:
    """Every `config_file_name`-named JSON file under path -> {(E, N, K, dtype, device): {M: config}}."""
    table: dict[Key, dict[int, dict]] = {}
    for file in sorted(Path(path).glob("*.json")):
        match = _FILE_RE.fullmatch(file.name)
        if match is None:
            raise ValueError(f"{file}: not a fused-MoE config name ({config_file_name('E', 'N', 'K', 'dtype', 'dev')})")
        E, N, K, device, dtype = match.groups()
        buckets = json.loads(file.read_text())
        table[(int(E), int(N), int(K), dtype, device)] = {int(m): _checked(c, file) for m, c in buckets.items()}
    return table


@functools.cache
def _tuned() -> dict[Key, dict[int, dict]]:
    return load_config_dir(CONFIG_DIR)


def get_config(num_experts: int, N: int, K: int, dtype_name: str, device_name: str, M: int,
               table: dict[Key, dict[int, dict]] | None = None) -> dict:
    """The tuned config of the M bucket nearest to M for this shape and device (table defaults to
    `kernels/configs/*.json`, read once), else `default_config`. Returns a fresh dict."""
    assert dtype_name in DTYPE_NAMES, dtype_name
    buckets = (_tuned() if table is None else table).get((num_experts, N, K, dtype_name, device_name))
    if buckets:
        return dict(buckets[min(buckets, key=lambda m: (abs(m - M), m))])
    return default_config(num_experts, N, K, dtype_name, device_name, M)


def default_config(num_experts: int, N: int, K: int, dtype_name: str, device_name: str, M: int) -> dict:
    """Untuned fallbacks. CPU (the Triton interpreter, for tests): large tiles, because interpreting
    costs per program and per op, not per FLOP. GPU: small BLOCK_M while there are few tokens per
    expert (decode), bigger tiles and grouped launch order for prefill (the usual fused-MoE starting
    points; nothing here was measured on a GPU)."""
    if device_name == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
    if M <= num_experts:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    if dtype_name == "fp8_w8a8":
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=16, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)


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
    import torch
    import triton.testing

    from kernels.fused_moe_triton import FP8, quantize_fp8_per_expert, fused_experts_triton

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
        assert w13.dtype == FP8
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
    _tuned.cache_clear()
    return best


def _checked(config: dict, source) -> dict:
    missing = {"BLOCK_M", "BLOCK_N", "BLOCK_K"} - config.keys()
    if missing:
        raise ValueError(f"{source}: config {config} lacks {sorted(missing)}")
    return dict(config)
