"""Which kernels a stage computes with, chosen once when the stage is built (`--moe-backend`).

- "native": kernels/csrc/cpu_gemm.c for every linear layer, the lm_head and the routed experts
  (weights packed once at load; CPU only);
- "torch": torch's own matmul (MKL on CPU) and the vectorised torch MoE;
- "triton": the Triton fused-MoE kernels for the experts (CUDA, or the interpreter on CPU), torch
  for the rest;
- "auto": Triton on CUDA; native on CPU where a C compiler is present, else torch.
"""

from __future__ import annotations

from moemesh.config import MOE_BACKENDS as BACKENDS  # the names, with the flag that takes them
from moemesh.errors import ConfigError


class BackendError(ConfigError):
    """Kernels that cannot run here (a CLI error: it names the flag)."""


def resolve_backend(name: str, device) -> str:
    """"auto" and the device (a torch.device or its name) -> "torch" | "native" | "triton"; refuses
    what cannot run here."""
    import torch

    if name not in BACKENDS:
        raise BackendError(f"--moe-backend {name!r} is not one of {', '.join(BACKENDS)}")
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        if not on_cpu:
            return "triton"
        from moemesh_kernels.cpu_gemm import native

        return "native" if native() is not None else "torch"
    if name == "native":
        if not on_cpu:
            raise BackendError("--moe-backend native runs on the CPU only")
        from moemesh_kernels.cpu_gemm import native

        if native() is None:
            from moemesh_kernels import cpu_gemm

            raise BackendError(f"--moe-backend native: the CPU kernels could not be built here "
                               f"({cpu_gemm.build_error}); use --moe-backend torch")
    return name


def check_device(device: str, flag: str = "--device") -> None:
    """Refuses (BackendError, naming the flag) a CUDA device this host's torch cannot use; the device a
    process is about to compute on, so that it fails in one line before anything starts."""
    if not str(device).startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise BackendError(f"{flag} {device}: this torch build or host has no CUDA device "
                           f"(torch {torch.__version__}, cuda {torch.version.cuda})")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise BackendError(f"{flag} {device}: this host has {torch.cuda.device_count()} CUDA devices")
