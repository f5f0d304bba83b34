"""Block sizes of the fused-MoE Triton kernels, kept as data.

Legend: E = experts (on this rank), N x K = the first GEMM of an expert (N = 2I output rows of w13,
K = H reduction), M = tokens in the batch (T). A config is
{BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages}; one config serves both GEMMs of a layer.

Tuned entries live in `kernels/configs/*.json`, one file per (E, N, K, device, dtype) named by
`config_file_name`, each holding {"M": config} for a few M buckets; `get_config` takes the bucket
nearest to M. Shapes with no file fall back to `default_config`. `moemesh_kernels.moe_tune.tune` writes such
files; it needs a CUDA GPU (Triton's do_bench), and no tuned file has been measured for this project yet.

This module is the table only: it imports no kernel (the kernels import it, to look their blocks up).
"""

from __future__ import annotations

import functools
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
def tuned_table() -> dict[Key, dict[int, dict]]:
    """`kernels/configs/*.json`, read once (`tuned_table.cache_clear()` re-reads it after a tune)."""
    return load_config_dir(CONFIG_DIR)


def get_config(num_experts: int, N: int, K: int, dtype_name: str, device_name: str, M: int,
               table: dict[Key, dict[int, dict]] | None = None) -> dict:
    """The tuned config of the M bucket nearest to M for this shape and device (table defaults to
    `kernels/configs/*.json`, read once), else `default_config`. Returns a fresh dict."""
    assert dtype_name in DTYPE_NAMES, dtype_name
    buckets = (tuned_table() if table is None else table).get((num_experts, N, K, dtype_name, device_name))
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


def _checked(config: dict, source) -> dict:
    missing = {"BLOCK_M", "BLOCK_N", "BLOCK_K"} - config.keys()
    if missing:
        raise ValueError(f"{source}: config {config} lacks {sorted(missing)}")
    return dict(config)
