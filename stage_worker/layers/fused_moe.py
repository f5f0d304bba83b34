"""FusedMoE: one layer for the routed experts of a MoE block.

Legend: T = tokens, E = experts in the model, E_local = experts on this rank (`num_local_experts`),
K = experts per token, H = hidden, I = expert intermediate size, I_p = I / tp
(`intermediate_size_per_partition`).

The layer owns the stacked expert weights `w13_weight [E_local, 2 * I_p, H]` (each expert's w1 (gate)
rows, then its w3 (up) rows) and `w2_weight [E_local, H, I_p]`, routing, and the all-reduce. How the
weights are stored and multiplied is the business of a method object (`UnquantizedFusedMoEMethod`,
or what `quant.moe_method()` returns); another method (FP8) creates other parameters and computes
differently, with no change to the layer or the model files.

The backend (moemesh_kernels.backend: "torch", "native", "triton"; `layer.backend`, set by
`CausalLM.set_backend`) is chosen once: `process_weights_after_loading` lays the weights out for it and
binds its routing (`layer.route`) and its expert computation (`quant_method.experts`); forward calls
them and never looks at the backend's name. A layer not yet laid out computes with torch.

Tensor parallelism splits I: each rank holds a column slice of every expert's w1/w3 and the matching
row slice of w2, and the partial sums meet in one all-reduce (the model may defer it to add a shared
expert first). With `tp.expert_parallel`, each rank instead holds whole experts E/tp.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from moemesh_kernels import cpu_gemm, moe_torch
from stage_worker.layers.linear import check_shape, cpu_gemm_layout, native_pack
from stage_worker.layers.parallel import TPGroup

# router_logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64)
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (layer, x [T, H], topk_weights [T, K], topk_ids [T, K]) -> [T, H] in x's dtype
Experts = Callable[["FusedMoE", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bind_router(backend: str, top_k: int, renormalize: bool) -> Router:
    """The backend's routing: softmax in float32, the top K, renormalized if asked (the three agree)."""
    if backend == "triton":
        from moemesh_kernels.fused_moe_triton import topk_softmax

        return lambda logits: topk_softmax(logits.contiguous(), top_k, renormalize, ids_dtype=torch.int64)
    if backend == "native":
        lib = cpu_gemm.native()
        return lambda logits: cpu_gemm.topk_softmax(logits, top_k, renormalize, lib)
    return functools.partial(moe_torch.select_experts, top_k=top_k, renormalize=renormalize)


def bind_experts(backend: str) -> Experts:
    """The backend's expert computation on unquantized (or dequantized) weights: "native" reads
    `layer.packed`, the others `layer.w13_weight` and `layer.w2_weight`."""
    if backend == "native":
        lib = cpu_gemm.native()

        def experts(layer, x, topk_weights, topk_ids):
            w13, w2 = layer.packed
            return cpu_gemm.fused_moe(x.float(), w13, w2, topk_weights, topk_ids, layer.expert_offset, lib).to(x.dtype)
    elif backend == "triton":
        from moemesh_kernels.fused_moe_triton import fused_experts_triton

        def experts(layer, x, topk_weights, topk_ids):
            return fused_experts_triton(x.contiguous(), layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                        expert_offset=layer.expert_offset)
    else:
        def experts(layer, x, topk_weights, topk_ids):
            return moe_torch.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                           expert_offset=layer.expert_offset)
    return experts


class UnquantizedFusedMoEMethod:
    def __init__(self):
        self.experts: Experts = bind_experts("torch")  # process_weights_after_loading binds the backend's

    def create_weights(self, layer: "FusedMoE") -> None:
        E, H, I_p = layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_partition
        layer.w13_weight = nn.Parameter(torch.empty(E, 2 * I_p, H), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(E, H, I_p), requires_grad=False)

    native_weight_type: torch.dtype | None = None  # as UnquantizedLinearMethod's

    @staticmethod
    def torch_weight(w: torch.Tensor) -> torch.Tensor:
        return w

    def process_weights_after_loading(self, layer: "FusedMoE") -> None:
        w13 = native_pack(layer.backend, layer.w13_weight.data, self.native_weight_type)
        if w13 is not None:
            layer.packed = (w13, native_pack(layer.backend, layer.w2_weight.data, self.native_weight_type))
            del layer.w13_weight, layer.w2_weight
            self.experts = bind_experts("native")
            return
        layer.w13_weight.data = cpu_gemm_layout(self.torch_weight(layer.w13_weight.data))
        layer.w2_weight.data = cpu_gemm_layout(self.torch_weight(layer.w2_weight.data))
        # "native" with weights its kernels do not read as they are (e.g. float16): torch's experts
        self.experts = bind_experts("triton" if layer.backend == "triton" else "torch")

    def apply(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_* [T, K] -> [T, H], by the kernel bound for the layer's backend."""
        return self.experts(layer, x, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: TPGroup, *, checkpoint_names: tuple[str, str, str] = ("w1", "w3", "w2"),
                 reduce_results: bool = True, quant=None):
        """checkpoint_names: how the checkpoint calls each expert's gate, up and down projections
        (Mixtral: w1, w3, w2; Qwen: gate_proj, up_proj, down_proj)."""
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.expert_parallel = tp.expert_parallel
        if self.expert_parallel:
            self.num_local_experts = tp.split(num_experts, "experts")
            self.expert_offset = tp.rank * self.num_local_experts
            self.intermediate_size_per_partition = intermediate_size
        else:
            self.num_local_experts, self.expert_offset = num_experts, 0
            self.intermediate_size_per_partition = tp.split(intermediate_size, "expert intermediate size")
        self.checkpoint_names = dict(zip(("w1", "w3", "w2"), checkpoint_names))
        self.reduce_results = reduce_results
        # "torch" | "native" | "triton" (moemesh_kernels.backend); the loader sets it before process_weights_after_loading
        self.backend = "torch"
        self.route: Router = bind_router(self.backend, top_k, renormalize)
        self.packed: tuple[cpu_gemm.PackedWeight, cpu_gemm.PackedWeight] | None = None  # (w13, w2), native
        self.quant_method = quant.moe_method() if quant is not None else UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self)
        for p in self.parameters(recurse=False):  # a quantization method may have set its own (scales)
            p.weight_loader = getattr(p, "weight_loader", self.weight_loader)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]."""
        topk_weights, topk_ids = self.route(router_logits)  # [T, K] each
        y = self.quant_method.apply(self, x, topk_weights, topk_ids)
        return self.tp.all_reduce(y) if self.reduce_results else y

    def process_weights_after_loading(self) -> None:
        """Lays the weights out for `self.backend` and binds its kernels; the backend is fixed from here."""
        self.quant_method.process_weights_after_loading(self)
        self.route = bind_router(self.backend, self.top_k, self.renormalize)

    # -- loading -------------------------------------------------------------------------------

    def checkpoint_sources(self, param_name: str) -> list[tuple[str, tuple[int, str]]]:
        """'w13_weight' -> [('{e}.w1.weight', (e_local, 'w1')), ('{e}.w3.weight', (e_local, 'w3')), ...]
        for this rank's experts, names relative to the layer (HF: `...experts.{e}.w1.weight`)."""
        stacked, suffix = param_name.split("_", 1)
        shards = ("w1", "w3") if stacked == "w13" else ("w2",)
        return [
            (f"{self.expert_offset + e}.{self.checkpoint_names[s]}.{suffix}", (e, s))
            for e in range(self.num_local_experts) for s in shards
        ]

    def weight_loader(self, param: nn.Parameter, tensor, shard_id: tuple[int, str]) -> None:
        """Copies expert `e`'s w1/w3/w2 (or this rank's slice of it) into the stacked parameter."""
        e, which = shard_id
        I_p = self.intermediate_size_per_partition
        rank = 0 if self.expert_parallel else self.tp.rank
        full_I = I_p if self.expert_parallel else I_p * self.tp.size
        dest = param.data[e]
        if which == "w2":  # [H, I]: this rank's columns
            check_shape(param, tensor.shape, (dest.shape[0], full_I))
            dest.copy_(tensor[:, rank * I_p:(rank + 1) * I_p])
        else:  # [I, H]: this rank's rows, into the gate or the up half
            check_shape(param, tensor.shape, (full_I, dest.shape[1]))
            half = 0 if which == "w1" else I_p
            dest[half:half + I_p].copy_(tensor[rank * I_p:(rank + 1) * I_p])
