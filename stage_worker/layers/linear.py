"""Linear layers that hide tensor parallelism from model files.

Model code passes global sizes; each layer keeps its rank's shard and knows how to load that shard
from a checkpoint tensor (a lazy slice: only the rows or columns this rank needs are read).

- `ReplicatedLinear`: every rank holds the whole weight (router gates).
- `ColumnParallelLinear`: output features split; no communication.
- `MergedColumnParallelLinear`: several column-parallel weights stored as one (gate_up).
- `QKVParallelLinear`: q/k/v heads split (k/v replicated when there are fewer kv heads than ranks).
- `RowParallelLinear`: input features split; one all-reduce, then the bias.

The arithmetic is a method object: `UnquantizedLinearMethod`, or whatever `quant.linear_method()`
returns when the model is built with a quantization config; a quantized method creates other
parameters and computes differently, with no change to the layers or the model files.

`layer.backend` ("torch" or "native", set by the loader before `process_weights_after_loading`)
says which kernels compute, and is read once there: with "native" the weight is packed once for
kernels/cpu_gemm.c (`layer.packed`), the [out, in] parameter is dropped and the method binds the
native GEMM (`kernel`); forward calls the bound kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh_kernels import cpu_gemm
from stage_worker.layers.parallel import TPGroup


NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # weight dtypes the native kernels read as they are


def native_pack(backend: str, w: torch.Tensor, weight_type: torch.dtype | None = None) -> "cpu_gemm.PackedWeight | None":
    """w packed for the native kernels, in `weight_type` (None: w's own dtype), when the stage runs
    them and they read that type; else None (torch's path keeps w)."""
    if backend == "native" and (weight_type is not None or w.dtype in NATIVE_DTYPES):
        return cpu_gemm.pack_for_native(w, weight_type)
    return None


def torch_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, layer.weight, bias)


def native_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return cpu_gemm.linear(x, layer.packed, bias)


class UnquantizedLinearMethod:
    # what a weight-only quantization changes (stage_worker.layers.int8): the type the native
    # kernels read, and the weight torch's path multiplies by instead
    native_weight_type: torch.dtype | None = None

    def __init__(self):
        self.kernel = torch_linear  # (layer, x [T, in], bias) -> [T, out]; process_weights_after_loading binds

    @staticmethod
    def torch_weight(w: torch.Tensor) -> torch.Tensor:
        return w

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed = native_pack(layer.backend, layer.weight.data, self.native_weight_type)
        if layer.packed is not None:
            del layer.weight
            self.kernel = native_linear
        else:
            layer.weight.data = cpu_gemm_layout(self.torch_weight(layer.weight.data))
            self.kernel = torch_linear

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(layer, x, bias)


def cpu_gemm_layout(w: torch.Tensor) -> torch.Tensor:
    """On CPU, the same [..., out, in] tensor stored column-major (each matrix's transpose is
    contiguous): x @ W^T then runs 1.3-1.8x faster for the few-row products of decoding (measured
    single-threaded on this project's CPUs; docs/benchmarks.md). Other devices: unchanged."""
    if w.device.type != "cpu" or w.dim() < 2:
        return w
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def load_whole(param: nn.Parameter, tensor, shard_id=None) -> None:
    """Default loader: the checkpoint tensor is the parameter."""
    check_shape(param, tensor.shape)
    param.data.copy_(tensor[:])


def check_shape(param: nn.Parameter, shape, expected=None) -> None:
    expected = tuple(param.shape) if expected is None else tuple(expected)
    if tuple(shape) != expected:
        raise ValueError(f"shape {tuple(shape)} in checkpoint, expected {expected}")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup, quant=None):
        super().__init__()
        self.tp = tp
        self.input_size = input_size  # per rank
        self.output_size = output_size  # per rank
        self.backend = "torch"  # the loader sets it (moemesh_kernels.backend) before process_weights_after_loading
        self.packed: cpu_gemm.PackedWeight | None = None  # the weight packed for the native kernels
        self.quant_method = quant.linear_method() if quant is not None else UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, output_size)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        for p in self.parameters(recurse=False):  # a quantization method may have set its own (scales)
            p.weight_loader = getattr(p, "weight_loader", self.weight_loader)

    def weight_loader(self, param: nn.Parameter, tensor, shard_id=None) -> None:
        load_whole(param, tensor)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup | None = None,
                 quant=None):
        super().__init__(input_size, output_size, bias, tp or TPGroup(), quant)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup, quant=None):
        super().__init__(input_size, tp.split(output_size, "output features"), bias, tp, quant)

    def weight_loader(self, param, tensor, shard_id=None) -> None:
        n = param.shape[0]
        check_shape(param, tensor.shape, (n * self.tp.size, *param.shape[1:]))
        param.data.copy_(tensor[self.tp.rank * n:(self.tp.rank + 1) * n])


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel weights side by side (e.g. gate_proj and up_proj as gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPGroup, quant=None):
        self.output_sizes = [tp.split(s, "output features") for s in output_sizes]  # per rank
        super().__init__(input_size, sum(self.output_sizes), bias, tp, quant)

    def weight_loader(self, param, tensor, shard_id: int) -> None:
        n = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        check_shape(param, tensor.shape, (n * self.tp.size, *param.shape[1:]))
        param.data[offset:offset + n].copy_(tensor[self.tp.rank * n:(self.tp.rank + 1) * n])


class QKVParallelLinear(LinearBase):
    """q, k and v projections as one weight [(heads + 2 * kv_heads) * head_dim, hidden] per rank."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, tp: TPGroup, quant=None):
        self.head_dim = head_dim
        self.num_heads = tp.split(total_num_heads, "attention heads")
        if total_num_kv_heads >= tp.size:
            self.num_kv_heads = tp.split(total_num_kv_heads, "key/value heads")
            kv_head_start = tp.rank * self.num_kv_heads
        else:  # fewer kv heads than ranks: each rank holds a copy of one kv head
            if tp.size % total_num_kv_heads:
                raise ValueError(f"tensor-parallel size {tp.size} is not a multiple of "
                                 f"key/value heads={total_num_kv_heads}")
            self.num_kv_heads = 1
            kv_head_start = tp.rank * total_num_kv_heads // tp.size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        # shard id -> (offset in this rank's weight, rows, first row in the checkpoint tensor)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.shards = {
            "q": (0, q, tp.rank * q),
            "k": (q, kv, kv_head_start * head_dim),
            "v": (q + kv, kv, kv_head_start * head_dim),
        }
        super().__init__(hidden_size, q + 2 * kv, bias, tp, quant)

    def weight_loader(self, param, tensor, shard_id: str) -> None:
        offset, rows, start = self.shards[shard_id]
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_shape(param, tensor.shape, (heads * self.head_dim, *param.shape[1:]))
        param.data[offset:offset + rows].copy_(tensor[start:start + rows])


class RowParallelLinear(LinearBase):
    """Input features split; partial products summed by one all-reduce; the bias added once after."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup, quant=None,
                 reduce_results: bool = True):
        self.reduce_results = reduce_results
        super().__init__(tp.split(input_size, "input features"), output_size, bias, tp, quant)

    def weight_loader(self, param, tensor, shard_id=None) -> None:
        if param is self.bias:
            return load_whole(param, tensor)
        n = param.shape[1]
        check_shape(param, tensor.shape, (param.shape[0], n * self.tp.size))
        param.data.copy_(tensor[:, self.tp.rank * n:(self.tp.rank + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
