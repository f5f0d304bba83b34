"""Tensors on the wire, the worker's side: a tensor as (TensorMeta, bytes) for `Codec.encode`, and a
received frame (already checked by `Codec.decode`) as a tensor without a copy."""

from __future__ import annotations

import warnings

import torch

from moemesh.protocol import ProtocolError, TensorMeta

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32}
_NAMES = {v: k for k, v in DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(_NAMES[t.dtype], list(t.shape))


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """t's bytes, a zero-copy view when t is contiguous on the CPU (keep t alive until sent)."""
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def frames_of(tensors) -> tuple[list[TensorMeta], list[memoryview]]:
    return [tensor_meta(t) for t in tensors], [tensor_buffer(t) for t in tensors]


def from_frame(meta: TensorMeta, buf) -> torch.Tensor:
    """A frame `Codec.decode` accepted (dtype known, size right) as a tensor over its bytes;
    ProtocolError for a shape torch cannot make (an empty tensor with huge other dimensions)."""
    dtype = DTYPES[meta.dtype]
    if not len(buf):
        try:
            return torch.empty(meta.shape, dtype=dtype)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ProtocolError(f"tensor shape {meta.shape}: {e}") from None
    with warnings.catch_warnings():  # received frames are read-only; these tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).view(meta.shape)
