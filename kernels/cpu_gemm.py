"""Native CPU kernels (kernels/csrc/cpu_gemm.c): a GEMM over pre-packed weights and a fused MoE.

Legend: M = rows (tokens), N = output features, K = input features, E = experts on this rank,
H = hidden, I = expert intermediate size (this rank's share), NR = columns of a packed panel
(2 SIMD registers: 16 floats with AVX2, 32 with AVX-512).

The C source is compiled on first use for the machine it runs on (`cc -O3 -march=native
-fopenmp`, 10-15 seconds) and cached under ~/.cache/moemesh/kernels, keyed by the source, the
compiler and the CPU's feature flags; it is loaded with ctypes (no torch headers to compile, and
ctypes releases the GIL for the call, so a worker's asyncio thread keeps running). Where no C
compiler is present `native()` is None and the layers keep torch's path. A C++ compiler, where there
is one, adds csrc/topk_order.cpp: torch.topk's choice among exactly tied router scores.

Weights are packed once after loading (`pack`): [N, K] -> [ceil(N / NR), K, NR], each panel the
K x NR block the kernel's register tile streams through, in float32, bfloat16 or int8 (with a
float32 scale per output feature). Activations are float32 in and out. Where the CPU has
AVX512-BF16, a bfloat16 panel stores rows k and k + 1 paired (`pair_panels`), as vdpbf16ps and AMX
tiles read them, and products with more than three rows multiply them with vdpbf16ps by
the activations rounded to bfloat16, as llama.cpp and torch's bfloat16 matmul do: twice the
multiply-adds per instruction of the float32 FMA.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moemesh_kernels.memory import empty_huge, huge_copy

log = logging.getLogger("moemesh.kernels")

SOURCE = Path(__file__).parent / "csrc" / "cpu_gemm.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fno-math-errno")
ORDER_SOURCE = SOURCE.parent / "topk_order.cpp"
CXXFLAGS = ("-O2", "-fPIC", "-fno-exceptions", "-fno-rtti", "-fvisibility=hidden", "-c")
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moemesh" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


class WeightDesc(ctypes.Structure):
    """C `mm_weight`: a packed weight, its int8 scales and bias (NULL when absent)."""
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("wt", ctypes.c_int64)]


class LayerDesc(ctypes.Structure):
    """C `mm_layer`: every pointer and size one decoder layer's decode step needs (see cpu_gemm.c)."""
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("eps", ctypes.c_double), ("qk_eps", ctypes.c_double),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", WeightDesc), ("o", WeightDesc), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("kv_type", ctypes.c_int64), ("block_size", ctypes.c_int64), ("moe", ctypes.c_int64),
                ("gate_up", WeightDesc), ("down", WeightDesc), ("router", WeightDesc), ("shared_gate", WeightDesc),
                ("experts", ctypes.c_int64), ("top_k", ctypes.c_int64), ("expert_offset", ctypes.c_int64),
                ("moe_intermediate", ctypes.c_int64), ("renormalize", ctypes.c_int64), ("moe_wt", ctypes.c_int64),
                ("w13", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("s13", ctypes.c_void_p), ("s2", ctypes.c_void_p),
                ("moe_wt2", ctypes.c_int64)]


def weight_desc(w: "PackedWeight | None", bias: torch.Tensor | None = None) -> WeightDesc:
    if w is None:
        return WeightDesc()
    if bias is not None:
        assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == w.n
    check_layout(w, native())
    return WeightDesc(w.data.data_ptr(), _ptr(w.scale), _ptr(bias), w.n, w.k, w.weight_type)


def check_layout(w: "PackedWeight", lib: "_Lib") -> None:
    """Refuses a weight packed for other kernels: bfloat16 rows are paired (`pair_panels`) exactly
    where the kernels were built with AVX512-BF16; int8 ones may be in quads (`quad_panels`) only
    where they were built with AMX-INT8 (and in rows anywhere)."""
    if w.data.dtype == torch.int8:
        if w.pairs and not (lib.i8_quads and w.k % 4 == 0):
            raise ValueError("an int8 weight packed in AMX-INT8's quads for kernels that read its rows in order")
        return
    if w.pairs != (w.data.dtype == torch.bfloat16 and lib.bf16_pairs):
        raise ValueError(f"a bfloat16 weight packed with its rows {'paired' if w.pairs else 'in order'} for "
                         f"kernels that read them {'paired' if lib.bf16_pairs else 'in order'}")


class _Lib:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.mm_gemm.argtypes = [i64, i64, i64, ptr, i64, ptr, i32, ptr, ptr, i64, i32]
        lib.mm_gemm.restype = i32
        lib.mm_moe.argtypes = [i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, i32, i32, ptr, i32]
        lib.mm_moe.restype = i32
        lib.mm_decode_attention.argtypes = [i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i32, i64, ptr, i64,
                                            ptr, ctypes.c_float, i32]
        lib.mm_decode_attention.restype = i32
        lib.mm_rmsnorm.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr, ptr, ctypes.c_float, ptr, i32]
        lib.mm_rmsnorm.restype = None
        lib.mm_rotary.argtypes = [i64, i64, i64, ptr, i64, ptr, ptr, ptr]
        lib.mm_rotary.restype = None
        lib.mm_topk_softmax.argtypes = [i64, i64, ptr, i64, i64, i32, ptr, ptr]
        lib.mm_topk_softmax.restype = None
        lib.mm_decoder_layers.argtypes = [ctypes.POINTER(LayerDesc), i64, i64, ptr, ptr, i32, ptr, ptr, ptr, i64, ptr,
                                           i32]
        lib.mm_decoder_layers.restype = i32
        lib.mm_argmax_rows.argtypes = [i64, i64, ptr, i64, ptr]
        lib.mm_screened_argmax.argtypes = [i64, i64, i64, ptr, i32, i64, ptr, i64, ptr, ctypes.c_float, ptr, i32, ptr,
                                           ptr, i32]
        lib.mm_screened_argmax.restype = None
        lib.mm_greedy_decode.argtypes = [ctypes.POINTER(LayerDesc), i64, i64, i64, ptr, i32, ptr, ctypes.c_float, ptr,
                                         i32, ptr, i64, i64, ptr, i32, ptr, ptr, ctypes.c_float, ptr, ptr, ptr, i64,
                                         i64, i64, ptr, i32]
        lib.mm_greedy_decode.restype = i32
        lib.mm_argmax_rows.restype = None
        lib.mm_read_sum.argtypes = [ptr, i64, i32]
        lib.mm_read_sum.restype = ctypes.c_float
        lib.mm_bf16_pairs.restype = i32
        lib.mm_i8_quads.restype = i32
        lib.mm_torch_tie_order.restype = i32
        lib.mm_set_prefetch.argtypes = [i32, i32]
        lib.mm_set_prefetch.restype = None
        lib.mm_set_amx.argtypes = [i32]
        lib.mm_set_amx.restype = None
        lib.mm_amx_available.restype = i32
        self.lib = lib
        self.path = path
        self.simd_width = lib.mm_simd_width()
        self.panel_width = lib.mm_panel_width()
        self.tile_rows = lib.mm_tile_rows()
        self.bf16_pairs = bool(lib.mm_bf16_pairs())  # bfloat16 panels paired for vdpbf16ps (AVX512-BF16)
        self.i8_quads = bool(lib.mm_i8_quads())  # int8 panels (K a multiple of 4) in AMX-INT8's quads (`native`)
        self.few_rows = lib.mm_few_rows()  # products with up to this many rows read weights as streams
        self.amx_i8_rows = lib.mm_amx_i8_rows()  # int8 products take AMX tiles from this many rows too
        self.torch_tie_order = bool(lib.mm_torch_tie_order())  # tied router scores broken as torch.topk does


def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout


def build(cache: Path | None = None) -> Path:
    """Compiles the kernels for this machine (or finds them compiled) and returns the library's path.
    Raises RuntimeError when there is no compiler or the build fails. A C++ compiler, where there is
    one, adds torch's order among tied router scores (csrc/topk_order.cpp); without it ties go to
    the lower expert (logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    try:
        version = _version(cc)
    except OSError as e:
        raise RuntimeError(f"C compiler {cc!r} does not run: {e}") from None
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    try:
        cxx_version = _version(cxx) if cxx else ""
    except (OSError, subprocess.SubprocessError):
        cxx, cxx_version = None, ""
    order_source = ORDER_SOURCE.read_text() if ORDER_SOURCE.is_file() else ""
    if not order_source:
        cxx = None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(CFLAGS), version, _cpu_flags(), platform.machine(),
                                    order_source, " ".join(CXXFLAGS), cxx_version]).encode()).hexdigest()[:16]
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"moemesh_cpu_{key}.so"
    if target.is_file():
        return target
    with open(cache / ".lock", "w") as lock:  # several workers starting at once build it once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=cache) as work:
            tmp = os.path.join(work, "lib.so")
            order = []
            if cxx is None:
                log.warning("no C++ compiler (c++, g++ or clang++) or no %s: tied router scores go to the lower "
                            "expert, not where torch.topk puts them", ORDER_SOURCE.name)
            else:
                obj = os.path.join(work, "topk_order.o")
                try:
                    r = subprocess.run([cxx, *CXXFLAGS, "-o", obj, str(ORDER_SOURCE)], capture_output=True, text=True,
                                       timeout=300)
                    failed = r.stderr.strip()[-2000:] if r.returncode else None
                except (OSError, subprocess.SubprocessError) as e:
                    failed = str(e)
                if failed is None:
                    order = ["-DMM_TORCH_ORDER", obj]
                else:
                    log.warning("%s failed on topk_order.cpp, tied router scores go to the lower expert: %s", cxx,
                                failed)
            r = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), *order], capture_output=True, text=True,
                               timeout=300)
            if order and (r.returncode != 0 or not _loads(tmp)):  # (an object that needs a C++ runtime library)
                log.warning("the kernels with topk_order.cpp's object did not link or load, tied router scores go to "
                            "the lower expert: %s", r.stderr.strip()[-2000:])
                r = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
            os.chmod(tmp, 0o755 & ~_umask())  # (a cache shared by users must be readable)
            os.replace(tmp, target)
    log.info("built CPU kernels %s", target)
    return target


def _loads(path: str) -> bool:
    try:
        ctypes.CDLL(path)
        return True
    except OSError:
        return False


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


build_error: str | None = None  # why native() is None


@functools.cache
def native() -> _Lib | None:
    """The compiled kernels, or None (logged once, the reason in build_error) where they cannot be
    built here; with this machine's prefetch policy set (`prefetch_policy`)."""
    global build_error
    try:
        lib = _Lib(build())
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        build_error = str(e) or type(e).__name__
        log.warning("native CPU kernels unavailable, using torch's matmul: %s", e)
        return None
    lib.prefetch = prefetch_policy(lib)
    lib.lib.mm_set_prefetch(*lib.prefetch)
    lib.amx = amx_rows(lib)
    lib.lib.mm_set_amx(lib.amx)
    # int8 weights in quads only where this process takes AMX tiles: without them, quads' products of
    # 5-16 rows per expert (AVX512-VNNI in half passes) ran 0.83-0.93x the register tiles' on panels
    # in rows (docs/benchmarks.md, "int8 panels in the tiles' quads")
    lib.i8_quads = lib.i8_quads and lib.amx > 0
    return lib


# products of paired bfloat16 weights with this many rows or more (every product past FEW_ROWS) go
# through AMX tiles: read in place, 8 rows of them took 0.08-0.09 ms where vdpbf16ps took 0.09-0.15
# at 4-7 rows, and 4 rows as long either way (docs/benchmarks.md, "bfloat16 panels stored as AMX
# reads them")
AMX_MIN_ROWS = 4


def amx_rows(lib: _Lib) -> int:
    """From how many rows products of bfloat16 weights multiply through AMX tiles here (cpu_gemm.c
    `panel_rows_amx`; int8 weights from that many and at least 5 in quads, `AMX_I8Q_ROWS`, or 8 in
    rows, `AMX_I8_ROWS`, `lib.amx_i8_rows`, where the build has AMX-INT8), or 0 where they do
    not: a CPU with AMX-BF16 whose kernel lets this process use it, unless MOEMESH_AMX says otherwise
    (0: off; N: from N rows, more than FEW_ROWS)."""
    text = os.environ.get("MOEMESH_AMX", "").strip()
    if text == "0" or not lib.lib.mm_amx_available():  # (off: not even the kernel's permission asked)
        return 0
    if not text:
        return AMX_MIN_ROWS
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if rows < 0 or 0 < rows <= lib.few_rows:
        log.warning("MOEMESH_AMX=%s is not 0 or a row count above %d: AMX tiles from %d rows", text, lib.few_rows,
                    AMX_MIN_ROWS)
        return AMX_MIN_ROWS
    return rows


# (non-temporal prefetch of weights read once, rows from which a one-tile product fetches the next
# panel): the kernels' default first, the others cpu_gemm.c's `mm_set_prefetch` names
PREFETCH_POLICIES = ((1, 8), (0, 4), (1, 4), (0, 8))


def prefetch_policy(lib: _Lib) -> tuple[int, int]:
    """The prefetch policy under which MoE layers at 1, 4, 6 and 8 rows per expert take the least
    time here (the rows of a decode step's experts; products of more rows do not depend on it,
    `_measure_prefetch`), measured once per library and machine and kept beside the library
    (`<library>.prefetch`). MOEMESH_PREFETCH="NTA,ROWS" sets it instead (e.g. "1,8")."""
    forced = os.environ.get("MOEMESH_PREFETCH")
    if forced:
        policy = _policy(lambda: forced)
        if policy:
            return policy
        log.warning("MOEMESH_PREFETCH=%r is not NTA,ROWS (e.g. 1,8): measuring instead", forced)
    kept = lib.path.with_name(lib.path.name + ".prefetch")
    policy = _policy(kept.read_text)
    if policy:
        return policy
    try:  # workers starting at once: one measures (on cores the others leave alone), the rest read it
        with open(lib.path.with_name(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _policy(kept.read_text) or _measure_prefetch(lib, kept)
    except OSError:  # (a cache this user cannot write: measured, not kept)
        return _measure_prefetch(lib, kept)


def _policy(read) -> tuple[int, int] | None:
    """"NTA,ROWS" as `read()` gives it, or None where it cannot be read or parsed."""
    try:
        nta, rows = (int(v) for v in read().split(","))
        return nta, rows
    except (OSError, ValueError):
        return None


def _measure_prefetch(lib: _Lib, kept: Path) -> tuple[int, int]:
    """`prefetch_policy`'s timing, its choice written to `kept` (where it can be: delete the file to
    measure again). Timed on what a decode step's products are: two MoE layers of 8 experts (512 x
    1024, float32, 48 MB each, read in turn as a stage reads its layers) with 1, 4, 6 and 8 rows per
    expert, in three rounds that take the policies in turn (each round in another order); a
    policy's time is the sum over the row counts of its best round. (Timed on one 16 MB weight, one
    policy at a time, the choice on the Xeon of docs/benchmarks.md went either way from
    build to build, where MoE layers at 4-8 rows per expert ran 1.2-1.4x slower under one.)"""
    try:
        took = _time_prefetch(lib)
    except (MemoryError, RuntimeError) as e:  # (no memory for its layers: torch's allocator raises RuntimeError)
        log.warning("could not time the CPU kernels' prefetch policy (%s): %s, not kept", e, PREFETCH_POLICIES[0])
        return PREFETCH_POLICIES[0]
    policy = min(PREFETCH_POLICIES, key=took.get)
    log.info("CPU kernels' prefetch policy %s (MoE layers at 1, 4, 6 and 8 rows per expert: %s)", policy,
             ", ".join(f"{p}: {t * 1e3:.2f} ms" for p, t in took.items()))
    try:
        tmp = kept.with_name(f"{kept.name}.{os.getpid()}")
        tmp.write_text(f"{policy[0]},{policy[1]}\n")
        os.replace(tmp, kept)
    except OSError:
        pass
    return policy


def _time_prefetch(lib: _Lib) -> dict[tuple[int, int], float]:
    """`_measure_prefetch`'s timing: seconds per policy."""
    g = torch.Generator().manual_seed(0)
    E, H, I = 8, 512, 1024
    layers = [(pack(torch.randn(E, 2 * I, H, generator=g), lib.panel_width),
               pack(torch.randn(E, H, I, generator=g), lib.panel_width)) for _ in range(2)]
    cases = []
    for rows in (1, 4, 6, 8):  # (token t picks experts 2t and 2t + 1 mod E: every expert `rows` rows)
        T = rows * E // 2
        cases.append((torch.randn(T, H, generator=g), (torch.arange(2 * T) % E).view(T, 2), torch.full((T, 2), 0.5)))
    best = {(policy, i): float("inf") for policy in PREFETCH_POLICIES for i in range(len(cases))}
    n = len(PREFETCH_POLICIES)
    for r in range(3):
        for policy in PREFETCH_POLICIES[r % n:] + PREFETCH_POLICIES[:r % n]:
            lib.lib.mm_set_prefetch(*policy)
            for i, (x, ids, weights) in enumerate(cases):
                t = time.perf_counter()
                for w13, w2 in layers:
                    fused_moe(x, w13, w2, weights, ids, 0, lib)
                best[policy, i] = min(best[policy, i], time.perf_counter() - t)
    return {policy: sum(best[policy, i] for i in range(len(cases))) for policy in PREFETCH_POLICIES}


# -- packing ------------------------------------------------------------------------------------


@dataclass
class PackedWeight:
    """A weight [..., N, K] packed for the kernels: data [..., ceil(N / NR), K, NR] (weight type
    float32, bfloat16 or int8; `pairs`: for bfloat16 on a CPU with AVX512-BF16, each panel's rows
    of k paired, `pair_panels`; for int8 on one with AMX-INT8 and K a multiple of 4, each panel's
    rows in AMX-INT8's quads, `quad_panels`), scale [..., ceil(N / NR) * NR] float32 for int8, else
    None."""

    data: torch.Tensor
    scale: torch.Tensor | None
    n: int
    k: int
    pairs: bool = False

    @property
    def weight_type(self) -> int:
        return 3 if self.pairs and self.data.dtype == torch.int8 else WEIGHT_TYPES[self.data.dtype]  # (3: W_I8Q)

    def unpack(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [..., N, K] in float32 (int8 times its scales), or in `dtype` (float64: the
        products with the scales exact): for tests, fallbacks and the screened head's bounds."""
        lead = self.data.shape[:-3]
        data = self.data if not self.pairs else unquad_panels(self.data) if self.data.dtype == torch.int8 \
            else unpair_panels(self.data)
        w = data.to(dtype).transpose(-1, -2).reshape(*lead, -1, self.k)
        if self.scale is not None:
            w = w * self.scale.to(dtype).unsqueeze(-1)
        return w[..., :self.n, :]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (q int8 [..., N, K], scale float32 [..., N]) with w ~ q * scale[n]: symmetric,
    one scale per output feature (amax / 127), round to nearest. Error per element <= scale / 2."""
    scale = w.detach().float().abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(w.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def pack(w: torch.Tensor, panel_width: int, weight_type: torch.dtype | None = None,
         pairs: bool | None = None) -> PackedWeight:
    """[..., N, K] -> PackedWeight in `weight_type` (default: w's dtype; torch.int8 quantizes).
    pairs: bfloat16 panels with their rows paired (`pair_panels`), int8 ones in quads
    (`quad_panels`, K a multiple of 4); default: as the native kernels built here read them."""
    weight_type = weight_type or w.dtype
    if pairs is None:
        lib = native() if weight_type in (torch.bfloat16, torch.int8) else None
        pairs = lib is not None and (lib.bf16_pairs if weight_type == torch.bfloat16 else lib.i8_quads)
    pairs = pairs and (weight_type == torch.bfloat16 or (weight_type == torch.int8 and w.shape[-1] % 4 == 0))
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"no CPU kernel for {weight_type} weights (float32, bfloat16, int8)")
    *lead, n, k = w.shape
    scale = None
    if weight_type == torch.int8:
        w, scale = quantize_int8(w)
    else:
        w = w.to(weight_type)
    pad = -n % panel_width
    if pad:
        w = torch.cat([w, w.new_zeros(*lead, pad, k)], dim=-2)
        if scale is not None:
            scale = torch.cat([scale, scale.new_ones(*lead, pad)], dim=-1)
    panels = (n + pad) // panel_width
    w = w.reshape(*lead, panels, panel_width, k).transpose(-1, -2)
    if pairs:
        w = pair_panels(w) if weight_type == torch.bfloat16 else quad_panels(w)
    data = huge_copy(w)  # (streamed whole by every decode step: kernels/memory.py)
    return PackedWeight(data, None if scale is None else scale.contiguous(), n, k, pairs=pairs)


def pair_panels(panels: torch.Tensor) -> torch.Tensor:
    """Panels [..., K, NR] with their columns in order -> the same with rows k and k + 1 paired, as
    vdpbf16ps and AMX tiles read them (cpu_gemm.c, BF16_PAIRS): row 2j holds columns 0 .. NR / 2 - 1
    of k = 2j and 2j + 1 side by side ((2j, 2j + 1) of column 0, then of column 1, ...), row 2j + 1
    columns NR / 2 .. NR - 1; an odd K's last row stays in order."""
    *lead, K, NR = panels.shape
    even = K - K % 2
    body = panels[..., :even, :].reshape(*lead, even // 2, 2, 2, NR // 2)  # [j, t, h, c]
    body = body.transpose(-3, -2).transpose(-2, -1).reshape(*lead, even, NR)  # [j, h, c, t]
    return torch.cat([body, panels[..., even:, :]], dim=-2)


def unpair_panels(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of `pair_panels`: paired panels [..., K, NR] -> their columns in order."""
    *lead, K, NR = panels.shape
    even = K - K % 2
    body = panels[..., :even, :].reshape(*lead, even // 2, 2, NR // 2, 2)  # [j, h, c, t]
    body = body.transpose(-2, -1).transpose(-3, -2).reshape(*lead, even, NR)  # [j, t, h, c]
    return torch.cat([body, panels[..., even:, :]], dim=-2)


def quad_panels(panels: torch.Tensor) -> torch.Tensor:
    """int8 panels [..., K, NR] with their columns in order (K a multiple of 4) -> the same bytes as
    AMX-INT8's B tiles read them (cpu_gemm.c, W_I8Q): each 4 rows of k a block of 4 NR bytes,
    columns 0 .. NR / 2 - 1 then NR / 2 .. NR - 1, each column's 4 k side by side."""
    *lead, K, NR = panels.shape
    assert K % 4 == 0
    q = panels.reshape(*lead, K // 4, 4, 2, NR // 2)  # [g, t, h, c]
    return q.permute(*range(len(lead)), -4, -2, -1, -3).reshape(*lead, K, NR)  # [g, h, c, t]


def unquad_panels(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of `quad_panels`."""
    *lead, K, NR = panels.shape
    q = panels.reshape(*lead, K // 4, 2, NR // 2, 4)  # [g, h, c, t]
    return q.permute(*range(len(lead)), -4, -1, -3, -2).reshape(*lead, K, NR)  # [g, t, h, c]


# -- calls ----------------------------------------------------------------------------------------


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def gemm(x: torch.Tensor, w: PackedWeight, lib: _Lib) -> torch.Tensor:
    """x [M, K] float32 -> x @ W^T [M, N] float32."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == w.k, (x.dtype, x.shape, w.k)
    if x.stride(1) != 1:
        x = x.contiguous()
    check_layout(w, lib)
    M = x.shape[0]
    y = torch.empty(M, w.n, dtype=torch.float32)
    if M:
        rc = lib.lib.mm_gemm(M, w.n, w.k, x.data_ptr(), x.stride(0), w.data.data_ptr(), w.weight_type,
                             _ptr(w.scale), y.data_ptr(), w.n, torch.get_num_threads())
        if rc:
            raise MemoryError("CPU GEMM: out of memory")
    return y


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) -> x @ W^T + bias [..., N] in x's dtype, through `gemm`."""
    lib = native()
    y = gemm(x.reshape(-1, w.k).float(), w, lib).to(x.dtype)
    y = y.view(*x.shape[:-1], w.n)
    return y if bias is None else y + bias


def pack_for_native(w: torch.Tensor, weight_type: torch.dtype | None = None) -> PackedWeight:
    """`pack` with this machine's panel width."""
    return pack(w, native().panel_width, weight_type)


def fused_moe(x: torch.Tensor, w13: PackedWeight, w2: PackedWeight, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_offset: int, lib: _Lib) -> torch.Tensor:
    """x [T, H] float32, w13 packed [E, 2I, H], w2 packed [E, H, I], topk_* [T, Ktop] -> [T, H] float32:
    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w1[e] @ x[t]) * (w3[e] @ x[t])), e = topk_ids[t, k],
    for the experts expert_offset .. expert_offset + E - 1 (others are skipped)."""
    assert x.dtype == torch.float32 and x.dim() == 2
    x = x.contiguous()
    T, H = x.shape
    E = w13.data.shape[0]
    check_layout(w13, lib)
    check_layout(w2, lib)
    # (the C code trusts these: a mismatch would read past a weight or a row)
    assert w13.k == H and w13.n == 2 * w2.k and w2.n == H and w2.data.shape[0] == E, \
        (x.shape, w13.n, w13.k, w2.n, w2.k)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == T, (topk_ids.shape, topk_weights.shape)
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty(T, H, dtype=torch.float32)
    if T:
        rc = lib.lib.mm_moe(T, H, w2.k, ids.shape[1], x.data_ptr(), ids.data_ptr(), weights.data_ptr(), E,
                            expert_offset, w13.data.data_ptr(), _ptr(w13.scale), w2.data.data_ptr(), _ptr(w2.scale),
                            w13.weight_type, w2.weight_type, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError("CPU fused MoE: out of memory")
    return out


def check_paged(block_table: torch.Tensor, kv_len: torch.Tensor, rows: int, num_blocks: int, block_size: int) -> None:
    """The C kernels trust block ids and lengths: refuse any that would reach outside the cache."""
    if block_table.shape[0] != rows or kv_len.shape != (rows,):
        raise ValueError(f"block tables {tuple(block_table.shape)} / lengths {tuple(kv_len.shape)} for {rows} rows")
    if rows and (int(kv_len.min()) < 1 or int(kv_len.max()) > block_table.shape[1] * block_size
                 or int(block_table.min()) < 0 or int(block_table.max()) >= num_blocks):
        raise ValueError("a block table or context length reaches outside the KV cache")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     kv_len: torch.Tensor, scale: float, lib: _Lib, checked: bool = False) -> torch.Tensor:
    """One query token per sequence over the paged KV cache (causal: it sees all L_s keys).

    q [S, h, D] float32; k_cache/v_cache [num_blocks, block_size, kvh, D] float32 or bfloat16 (this
    step's keys already written); block_table [S, max_blocks] int64; kv_len [S] int64 -> [S, h, D]
    float32: softmax(q k^T * scale) v per head, heads h // (h / kvh) sharing kv head h / G.
    checked: the caller has already bounded the block table and lengths (`check_paged`), once for
    every layer of a step (stage_worker.context.build_context's limits)."""
    S, h, D = q.shape
    nb, bs, kvh, Dk = k_cache.shape
    assert Dk == D and h % kvh == 0 and k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() \
        and v_cache.is_contiguous() and block_table.dtype == kv_len.dtype == torch.int64
    q = q.float().contiguous()
    block_table, kv_len = block_table.contiguous(), kv_len.contiguous()
    if not checked:
        check_paged(block_table, kv_len, S, nb, bs)
    out = torch.empty(S, h, D, dtype=torch.float32)
    if S:
        rc = lib.lib.mm_decode_attention(S, h, kvh, D, q.data_ptr(), h * D, out.data_ptr(), h * D, k_cache.data_ptr(),
                                         v_cache.data_ptr(), WEIGHT_TYPES[k_cache.dtype], bs, block_table.data_ptr(),
                                         block_table.shape[1], kv_len.data_ptr(), scale, torch.get_num_threads())
        if rc:
            raise MemoryError("CPU decode attention: out of memory")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
             lib: _Lib) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H] float32 (rows may be strided) -> (weight * r / rms(r), r) with r = x + residual, or
    (weight * x / rms(x), None) without a residual."""
    T, H = x.shape
    assert x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty(T, H, dtype=torch.float32)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == torch.float32 and residual.stride(1) == 1
        res_out = torch.empty(T, H, dtype=torch.float32)
    if T:
        lib.lib.mm_rmsnorm(T, H, x.data_ptr(), x.stride(0), _ptr(residual), residual.stride(0) if residual is not None
                           else 0, _ptr(res_out), weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out, res_out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lib: _Lib) -> None:
    """In place: x [T, heads, D] float32 (heads contiguous, rows may be strided), positions [T] int64,
    cos/sin [P, D] float32."""
    T, heads, D = x.shape
    assert x.dtype == cos.dtype == sin.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == D
    assert positions.dtype == torch.int64 and positions.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert cos.shape == sin.shape and cos.shape[1] == D, (cos.shape, sin.shape, D)
    if T:
        lib.lib.mm_rotary(T, heads, D, x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(),
                          sin.data_ptr())


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool, lib: _Lib) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, ids [T, K] int64): softmax in float32, the K
    largest, optionally renormalised to sum 1: moemesh_kernels.moe_torch.select_experts. Where the K-th is
    exactly tied with an expert left out, the experts torch.topk picks (with lib.torch_tie_order;
    without it, the lower ones; kernels/README.md)."""
    logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    T, E = logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"top-k {top_k} of {E} experts")
    weights = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    if T:
        lib.lib.mm_topk_softmax(T, E, logits.data_ptr(), logits.stride(0), top_k, int(renormalize),
                                weights.data_ptr(), ids.data_ptr())
    return weights, ids


def decoder_layers(descs: ctypes.Array, hidden: torch.Tensor, residual: torch.Tensor, first: bool,
                   positions: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor, kv_len: torch.Tensor,
                   lib: _Lib) -> None:
    """A stage's decoder layers for a decode step, one after the other, in place: descs, an array of
    LayerDesc; hidden [T, H] float32 (the first layer's input, then the last one's output), residual
    [T, H] float32 (written when `first`: the first layer starts the stream, else updated);
    positions, slots, kv_len [T] int64; block_table [T, max_blocks] int64. The tensors the
    descriptions point into must stay alive (the caller keeps them)."""
    T = hidden.shape[0]
    assert hidden.is_contiguous() and residual.is_contiguous() and hidden.dtype == residual.dtype == torch.float32
    rc = lib.lib.mm_decoder_layers(descs, len(descs), T, hidden.data_ptr(), residual.data_ptr(), int(first),
                                   positions.data_ptr(), slots.data_ptr(), block_table.data_ptr(), block_table.shape[1],
                                   kv_len.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError("CPU decoder layer: out of memory")


def argmax_rows(x: torch.Tensor, lib: _Lib) -> torch.Tensor:
    """x [R, n] float32 -> [R] int64: each row's first maximum (NaN counts as the maximum), as
    `x.max(dim=-1).indices`, in one pass over memory (torch's takes ~6x as long on [64, 32000])."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        lib.lib.mm_argmax_rows(x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), out.data_ptr())
    return out


# rows from which torch's product of the copy pays: on a Xeon with AMX, decode with it from one row
# ran 0.92x the full head at batch 1, 1.0x at batch 8, and 1.09x / 1.20x the native screen at batch
# 32 / 64 (docs/benchmarks.md, "A Xeon with AMX")
ONEDNN_MIN_ROWS = 16


def screen_product(head: PackedWeight, vocab: int, lib: _Lib | None) -> list[tuple[str, int]]:
    """How `ScreenedHead` should multiply this packed lm_head's copy here, each way from how many rows
    on (fewer, or rows no way takes, take the full product): [] where the full product samples greedy
    tokens fastest (no screen). A float32 head: its bfloat16 copy, through these kernels ("native",
    from one row: vdpbf16ps on a CPU with AVX512-BF16, 1.6x the full 64-row product on Zen 4) or
    through torch's matmul ("onednn", from ONEDNN_MIN_ROWS rows: AMX tiles on a CPU that has them, 3x
    the full product at 64 rows on a Xeon whose vdpbf16ps runs at half the rate of its float32 FMAs,
    where "native" loses to the full product), whichever samples 64 rows fastest ("onednn" from the
    fewest of 16, 32 or 64 rows where it also beats the full product). A bfloat16 head: its
    int8 copy ("int8", from one row; it is read only for up to FEW_ROWS rows, where a product is bound
    by reading its weights: half the bytes, wherever the kernels are built), and from ONEDNN_MIN_ROWS
    rows torch's matmul of the head itself ("onednn": 4.4x the vdpbf16ps product at 64 rows on that
    Xeon; as fast as its AMX tiles there) where it samples 64 rows faster than the full product. An int8 head (`--quantization int8`):
    torch's matmul of its bfloat16 copy from ONEDNN_MIN_ROWS rows where that is faster. Timed on a
    slice of the head (up to 4M weights: a tenth of a second or so in all)."""
    if lib is None or head.data.dim() != 3 or head.data.dtype not in (torch.float32, torch.bfloat16, torch.int8):
        return []
    NR, K = head.data.shape[-1], head.k
    panels = min(head.data.shape[0], max(1, (1 << 22) // (NR * K)))
    scale = None if head.scale is None else head.scale[:panels * NR]
    part = PackedWeight(head.data[:panels], scale, min(head.n, panels * NR), K, head.pairs)
    cols = min(vocab, part.n)
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(0))
    x *= 1 / x.norm(dim=1, keepdim=True)  # (a final norm's rows: their scale does not matter to the timing)
    ways = {None: lambda rows: argmax_rows(gemm(x[:rows], part, lib)[:, :cols], lib)}
    if head.data.dtype == torch.float32:
        native = ScreenedHead(part, cols, lib, "native")
        ways["native"] = lambda rows: native.tokens(x[:rows])
    try:  # torch's product, if this torch has one and it keeps the bound (float32 sums, rounded once)
        screen = ScreenedHead(part, cols, lib, "onednn")
        error = (screen.approx(x)[:, :cols].float() - gemm(x, part, lib)[:, :cols]).abs()
        if (error <= x.norm(dim=1, keepdim=True) * screen.radius).all():
            ways["onednn"] = lambda rows: screen.tokens(x[:rows])
        else:
            log.warning("torch's bfloat16 matmul strays beyond the screened head's bound here: not used")
    except RuntimeError as e:
        log.info("no bfloat16 matmul in torch here for the screened head: %s", e)
    def seconds(run, rows: int) -> float:
        run(rows)  # (warm: the first call pays for its buffers, torch's for its kernel)
        took = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            run(rows)
            took = min(took, time.perf_counter() - t)
        return took

    times = {product: seconds(run, 64) for product, run in ways.items()}
    best = min(times, key=times.get)
    min_rows = 1
    if best == "onednn":  # from the fewest rows (16, 32 or 64) where it beats the full product
        min_rows = next(r for r in (ONEDNN_MIN_ROWS, 2 * ONEDNN_MIN_ROWS, 64)
                        if r == 64 or seconds(ways["onednn"], r) < seconds(ways[None], r))
    chosen = [("int8", 1)] if head.data.dtype == torch.bfloat16 else []
    return chosen + ([] if best is None else [(best, min_rows)])


class HeadScreens:
    """Several screens of one head (`ScreenedHead`), each for the rows it `screens`, the first that
    does taking a product; rows that none screens take the full product. A bfloat16 head's int8 copy
    screens up to FEW_ROWS rows, torch's matmul of the head from ONEDNN_MIN_ROWS."""

    def __init__(self, screens: list["ScreenedHead"]):
        assert screens and all(s.head is screens[0].head and s.vocab == screens[0].vocab for s in screens)
        self.all = tuple(screens)
        self.head, self.vocab, self.lib = screens[0].head, screens[0].vocab, screens[0].lib

    def pick(self, rows: int) -> "ScreenedHead | None":
        """The screen of a product of `rows` rows, or None (the full product)."""
        return next((s for s in self.all if s.screens(rows)), None)

    def screens(self, rows: int) -> bool:
        return self.pick(rows) is not None

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] float32 (the final norm's output) -> [R] int64, each row's greedy token."""
        screen = self.pick(x.shape[0])
        if screen is not None:
            return screen.tokens(x)
        return self.all[0].tokens(x)  # (its full product, for rows it does not screen)


def screen_head(head: PackedWeight, vocab: int, lib: _Lib,
                choices: list[tuple[str, int]]) -> "ScreenedHead | HeadScreens | None":
    """The screen(s) of `screen_product`'s choices: None for none, a ScreenedHead for one."""
    screens = [ScreenedHead(head, vocab, lib, product, min_rows) for product, min_rows in choices]
    return None if not screens else screens[0] if len(screens) == 1 else HeadScreens(screens)


class ScreenedHead:
    """Greedy tokens from an lm_head at a fraction of its cost, exactly: the logits of a copy of the
    head in half the bytes (a float32 head's in bfloat16, multiplied by these kernels, with vdpbf16ps
    on a CPU with AVX512-BF16, or by torch's matmul: `product`, which `screen_product` times; a
    bfloat16 head's in int8, with a scale per column, for up to `max_rows` rows), a bound on how far
    each can be from the head's logit, and the float32 logits of only the few columns whose interval
    reaches the highest lower end (`mm_screened_argmax`). The token is the first maximum of those
    logits: the one the full product picks, up to the order float32 sums are added in (which already
    differs between this machine's kernels and torch's; and an int8 head's full product of 8 rows
    or more on AMX tiles reads x as three int8 parts, within 2^-23 of its largest element,
    cpu_gemm.c `quant_row`). A row with more than 64 candidates (or more
    than 256 still in reach when the kernel's buffer fills), a value that is not finite, or |x| times
    the largest column norm at or above 2^126 takes the full product, and so do all rows of a product
    with more than `max_rows`.

    The bound, for a row x and column j (w the head's column, w' the copy's, u = 2^-8 bfloat16's unit
    roundoff, g = K 2^-24 / (1 - K 2^-24) float32's for a sum of K products, and x' the row as the
    copy's product reads it: x, or x rounded to bfloat16 with |x - x'| <= u |x|):

        |x.w - x'.w'| <= |x.(w - w')| + |(x - x').w'| <= |x| (|w - w'| + u |w'|)     (Cauchy-Schwarz)

    plus g |x'| |w'| <= g (1 + u) |x| |w'| for the sum that computes x'.w', and g |x| |w| for the one
    that computes the head's logit: |approx - logit| <= |x| radius[j] with radius = |w - w'| +
    (u + g (1 + u)) |w'| + g |w|. The int8 copy's product reads x as it is (u = 0: a bfloat16 head
    widens its weights for up to FEW_ROWS rows, and so does int8 in rows) and multiplies its sum by
    the column's scale, one more rounding: g + 2^-24 (1 + g) in place of g for |w'|. A copy in quads
    (AMX-INT8 and AVX512-VNNI) multiplies each row's int8 parts (cpu_gemm.c `quant_row`), exact sums
    whose result is within 2^-21 max|x| sum|w'| <= 2^-21 sqrt(K) |x| |w'| of x.w' (scales included):
    the larger of that factor and the other in place of g for |w'|. Torch's product
    ("onednn") writes its float32 sums rounded to bfloat16: one more error of at most 2u times the
    sum (2u: rounded to nearest or cut), |x'.w'| (1 + g) <= |x| (1 + u) (1 + g) |w'|, so its radius has
    2u (1 + u) (1 + g) |w'| more. A bfloat16 head's "onednn" screen multiplies the head itself (w' = w);
    a product of more than FEW_ROWS rows rounds them to bfloat16 first, as the head's full product of
    that many rows reads them (x' = x there). An int8 head (--quantization int8) is screened only
    through torch's product of its bfloat16 copy (w the int8 weights times the column's scale, as
    the head's product computes); its own logit is a sum multiplied by the scale, g + 2^-24 (1 + g)
    in place of g for |w|. Computed in float64
    and widened by 2^-10 (which also covers the float32 arithmetic of the comparisons, each within
    2^-23 of values at most 2^9 radii). It assumes nothing overflows: rows with |x| times the largest
    column norm at or above 2^126 take the full product. Denormals that the bfloat16 instructions flush
    (activations and products below 2^-126) move a logit by under 2^-126 sqrt(K) times the column's
    norm: the comparisons allow 1e-30."""

    def __init__(self, head: PackedWeight, vocab: int, lib: _Lib, product: str | None = None, min_rows: int = 1):
        assert head.data.dtype in (torch.float32, torch.bfloat16, torch.int8) and 0 < vocab <= head.n
        assert head.data.dim() == 3 and (head.scale is None) == (head.data.dtype != torch.int8)
        if product is None:
            product = {torch.float32: "native", torch.bfloat16: "int8", torch.int8: "onednn"}[head.data.dtype]
        assert product in {torch.float32: ("native", "onednn"), torch.bfloat16: ("int8", "onednn"),
                           torch.int8: ("onednn",)}[head.data.dtype], product
        self.head, self.vocab, self.lib, self.product, self.min_rows = head, vocab, lib, product, min_rows
        K, NR = head.k, head.data.shape[-1]
        step = _panels_per_slice(head)
        g = K * 2.0 ** -24 / (1 - K * 2.0 ** -24)
        # the head's own logit: an int8 head's sum multiplied by its column's scale, one more rounding
        g_head = g if head.scale is None else g + 2.0 ** -24 * (1 + g)
        self.copy: PackedWeight | None = None  # the copy these kernels read ("native", "int8")
        self.copy_t: torch.Tensor | None = None  # [K, vocab] bfloat16, the copy torch's matmul reads ("onednn")
        rounded_out = 0.0
        if product == "native":
            # the copy, panel for panel (every column of the head, as the full product has them:
            # mm_greedy_decode runs both alike); torch's rounding to bfloat16 is pack's. Filled a
            # slice of panels at a time: no whole-head temporaries beside it
            data = empty_huge(head.data.shape, torch.bfloat16)
            for p in range(0, data.shape[0], step):
                panels = head.data[p:p + step].to(torch.bfloat16)
                data[p:p + step] = pair_panels(panels) if lib.bf16_pairs else panels
            self.copy = PackedWeight(data, None, head.n, head.k, pairs=lib.bf16_pairs)
            self.max_rows = None
            u, g_copy = 2.0 ** -8, g * (1 + 2.0 ** -8)
        elif product == "onednn":
            self.copy_t = empty_huge((K, vocab), torch.bfloat16)  # (filled with the radius, below)
            self.max_rows = None
            u, g_copy = 2.0 ** -8, g * (1 + 2.0 ** -8)
            rounded_out = 2 * u * (1 + u) * (1 + g)
        else:
            # (a bfloat16 head's product of more rows rounds x to bfloat16 and pairs it: not this copy's)
            self.copy = _int8_copy(head)
            self.max_rows = lib.few_rows
            # (a copy in quads multiplies the rows' int8 parts: within 2^-21 max|x| sum|w'| <= 2^-21 sqrt(K)
            # |x| |w'|, which g covers from K = 64 on)
            u, g_copy = 0.0, max(g + 2.0 ** -24 * (1 + g), 2.0 ** -21 * K ** 0.5 if self.copy.pairs else 0.0)
        radius, wn_max = torch.empty(vocab, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for p in range(0, -(-vocab // NR), step):
            w = _columns(head, p, step, vocab)
            if self.copy is not None:
                copy = _columns(self.copy, p, step, vocab)
            else:
                self.copy_t[:, p * NR:p * NR + len(w)] = w.t().to(torch.bfloat16)
                copy = self.copy_t[:, p * NR:p * NR + len(w)].t().double()
            norm, copy_norm = w.norm(dim=1), copy.norm(dim=1)
            radius[p * NR:p * NR + len(w)] = (w - copy).norm(dim=1) + (u + g_copy + rounded_out) * copy_norm \
                + g_head * norm
            wn_max = torch.maximum(wn_max, torch.maximum(norm.max(), copy_norm.max()))  # (NaN stays NaN)
        self.radius = (radius * (1 + 2.0 ** -10)).float().contiguous()
        # NaN or inf where a weight is: mm_screened_argmax's guard then decides no row here
        self.wn_max = float((wn_max * (1 + 2.0 ** -10)).float())

    def screens(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes through the copy (else the full product)."""
        return self.min_rows <= rows and (self.max_rows is None or rows <= self.max_rows)

    def pick(self, rows: int) -> "ScreenedHead | None":
        """This screen if it takes a product of `rows` rows, else None (`HeadScreens`' interface)."""
        return self if self.screens(rows) else None

    def approx(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] float32 -> the copy's logits [R, >= vocab]: float32 from these kernels, bfloat16
        from torch's matmul."""
        if self.copy_t is not None:
            approx = torch.mm(x.to(torch.bfloat16), self.copy_t)
            assert approx.stride(1) == 1 and approx.shape[1] == self.vocab  # (rows as mm_screened_argmax reads them)
            return approx
        return gemm(x, self.copy, self.lib)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, K] float32 (the final norm's output) -> [R] int64, each row's greedy token."""
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == self.head.k
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if not x.shape[0]:
            return out
        if not self.screens(x.shape[0]):
            return argmax_rows(gemm(x, self.head, self.lib)[:, :self.vocab], self.lib)
        if self.copy_t is not None and self.head.pairs and self.head.data.dtype == torch.bfloat16 \
                and x.shape[0] > self.lib.few_rows:
            # the full product of a paired bfloat16 head (AVX512-BF16) reads more than FEW_ROWS rows as
            # bfloat16: its logits are those of x so rounded, and so are the ones screened here (elsewhere
            # it reads x as it is, and the radius's u covers torch's rounding of the rows)
            x = x.to(torch.bfloat16).float()
        approx = self.approx(x)
        self.lib.lib.mm_screened_argmax(x.shape[0], self.vocab, x.shape[1], approx.data_ptr(),
                                        WEIGHT_TYPES[approx.dtype], approx.stride(0), x.data_ptr(), x.stride(0),
                                        self.radius.data_ptr(), self.wn_max, self.head.data.data_ptr(),
                                        self.head.weight_type, _ptr(self.head.scale), out.data_ptr(),
                                        torch.get_num_threads())
        full = (out < 0).nonzero().flatten()
        if len(full):
            out[full] = argmax_rows(gemm(x[full], self.head, self.lib)[:, :self.vocab], self.lib)
        return out


def _panels_per_slice(head: PackedWeight) -> int:
    """Panels of a head that its copies and bounds are built from at a time: 4M elements (float64
    slices of 32 MiB), never the whole head."""
    return max(1, (1 << 22) // (head.data.shape[-1] * head.k))


def _int8_copy(head: PackedWeight) -> PackedWeight:
    """pack(head.unpack(), NR, torch.int8), a slice of panels at a time (never the whole head in float32)."""
    panels, K, NR = head.data.shape
    data = empty_huge((panels, K, NR), torch.int8)
    scale = torch.ones(panels * NR, dtype=torch.float32)  # (padding columns: scale 1, as pack's)
    lib = native()
    quads = lib is not None and lib.i8_quads and K % 4 == 0  # (as pack lays int8 panels out)
    step = _panels_per_slice(head)
    for p in range(0, panels, step):
        cols = _columns(head, p, step, head.n).float()
        q, s = quantize_int8(cols)
        chunk = torch.zeros(min(step, panels - p) * NR, K, dtype=torch.int8)
        chunk[:len(q)] = q
        chunk = chunk.view(-1, NR, K).transpose(1, 2)
        data[p:p + step] = quad_panels(chunk) if quads else chunk
        scale[p * NR:p * NR + len(s)] = s
    return PackedWeight(data, scale, head.n, head.k, pairs=quads)


def _columns(w: PackedWeight, p: int, step: int, vocab: int) -> torch.Tensor:
    """Columns [p * NR, (p + step) * NR) of a 2-d packed weight below `vocab`, float64 [cols, K], as
    its kernels read them (`unpack` of those panels)."""
    NR = w.data.shape[-1]
    data = w.data[p:p + step]
    scale = None if w.scale is None else w.scale[p * NR:(p + len(data)) * NR]
    return PackedWeight(data, scale, min(vocab - p * NR, len(data) * NR), w.k, w.pairs).unpack(torch.float64)


def greedy_decode(descs: ctypes.Array, embed: torch.Tensor, norm: torch.Tensor, eps: float, head: PackedWeight,
                  vocab: int, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                  block_size: int, steps: int, lib: _Lib,
                  screen: "ScreenedHead | HeadScreens | None" = None) -> torch.Tensor:
    """`steps` greedy decode steps of a whole model (descs: every decoder layer's LayerDesc), each
    feeding back what the one before sampled: tokens, positions [S] int64 (each sequence's next
    input token and its position); block_table [S, max_blocks] int64, covering every position up to
    positions + steps - 1; embed [rows, H] float32 or bfloat16; norm [H] float32, the final norm's
    weight; head, the packed lm_head (its first `vocab` columns are the logits); screen: head's
    `ScreenedHead` or `HeadScreens`, to sample through the one that takes S rows (a copy these
    kernels read; torch's product cannot run inside the burst). -> [steps, S] int64, the tokens sampled. The caller checks
    the indices (the kernels trust them)."""
    S = tokens.shape[0]
    H = embed.shape[1]
    assert embed.dtype in (torch.float32, torch.bfloat16) and embed.is_contiguous() and head.k == H
    assert norm.dtype == torch.float32 and norm.is_contiguous() and norm.numel() == H and 0 < vocab <= head.n
    for t in (tokens, positions, block_table):
        assert t.dtype == torch.int64 and t.is_contiguous()
    assert positions.shape == (S,) and block_table.dim() == 2 and block_table.shape[0] == S
    check_layout(head, lib)
    screen = None if screen is None else screen.pick(S)
    if screen is not None and screen.copy is None:
        screen = None  # (torch's product of the copy cannot run inside the native burst: the full head does)
    if screen is not None:
        assert screen.head is head and screen.vocab == vocab
        check_layout(screen.copy, lib)
    out = torch.empty(steps, S, dtype=torch.int64)
    if S and steps:
        rc = lib.lib.mm_greedy_decode(descs, len(descs), S, H, embed.data_ptr(), WEIGHT_TYPES[embed.dtype],
                                      norm.data_ptr(), eps, head.data.data_ptr(), head.weight_type, _ptr(head.scale),
                                      head.n, vocab, None if screen is None else screen.copy.data.data_ptr(),
                                      0 if screen is None else screen.copy.weight_type,
                                      None if screen is None else _ptr(screen.copy.scale),
                                      None if screen is None else screen.radius.data_ptr(),
                                      0.0 if screen is None else screen.wn_max,
                                      tokens.data_ptr(), positions.data_ptr(), block_table.data_ptr(),
                                      block_table.shape[1], block_size, steps, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError("CPU greedy decode: out of memory")
    return out


def read_sum(x: torch.Tensor, lib: _Lib) -> float:
    """Sum of a float32 tensor, streamed with torch's thread count (a read-bandwidth probe)."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    return lib.lib.mm_read_sum(x.data_ptr(), x.numel(), torch.get_num_threads())
