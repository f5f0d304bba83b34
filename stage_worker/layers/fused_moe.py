"""FusedMoE: one layer for the routed experts of a MoE block.

Legend: T = tokens, E = experts in the model, E_local = experts on this rank (`num_local_experts`),
K = experts per token, H = hidden, I = expert intermediate size, I_p = I / tp
(`intermediate_size_per_partition`).

The layer owns the stacked expert weights `w13_weight [E_local, 2 * I_p, H]` (each expert's w1 (gate)
rows, then its w3 (up) rows) and `w2_weight [E_local, H, I_p]`, routing, and the all-reduce. How the
weights are stored and multiplied is the business of a method object (`UnquantizedFusedMoEMethod`,
or what `quant.moe_method()` returns); another method (FP8) creates other parameters and computes
differently, with no change to the layer or the model files.

Tensor parallelism splits I: each rank holds a column slice of every expert's w1/w3 and the matching
row slice of w2, and the partial sums meet in one all-reduce (the model may defer it to add a shared
expert first). With `tp.expert_parallel`, each rank instead holds whole experts E/tp.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_gemm, moe_torch
from stage_worker.layers.linear import check_shape, cpu_gemm_layout, native_pack
from stage_worker.layers.parallel import TPGroup


class UnquantizedFusedMoEMethod:
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
            return
        layer.w13_weight.data = cpu_gemm_layout(self.torch_weight(layer.w13_weight.data))
        layer.w2_weight.data = cpu_gemm_layout(self.torch_weight(layer.w2_weight.data))

    def apply(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if layer.packed is not None:
            w13, w2 = layer.packed
            y = cpu_gemm.fused_moe(x.float(), w13, w2, topk_weights, topk_ids, layer.expert_offset, cpu_gemm.native())
            return y.to(x.dtype)
        if layer.uses_triton(x):
            from kernels.fused_moe_triton import fused_experts_triton

            return fused_experts_triton(x.contiguous(), layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                        expert_offset=layer.expert_offset)
        return moe_torch.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                       expert_offset=layer.expert_offset)


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
        # "torch" | "native" | "triton" (kernels.backend); the loader sets it before process_weights_after_loading
        self.backend = "auto"
        self.packed: tuple[cpu_gemm.PackedWeight, cpu_gemm.PackedWeight] | None = None  # (w13, w2), native
        self.quant_method = quant.moe_method() if quant is not None else UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self)
        for p in self.parameters(recurse=False):  # a quantization method may have set its own (scales)
            p.weight_loader = getattr(p, "weight_loader", self.weight_loader)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]."""
        if self.uses_triton(x):
            from kernels.fused_moe_triton import topk_softmax

            topk_weights, topk_ids = topk_softmax(router_logits.contiguous(), self.top_k, self.renormalize,
                                                  ids_dtype=torch.int64)
        elif self.backend == "native":
            topk_weights, topk_ids = cpu_gemm.topk_softmax(router_logits, self.top_k, self.renormalize,
                                                           cpu_gemm.native())
        else:
            topk_weights, topk_ids = moe_torch.select_experts(router_logits, self.top_k, self.renormalize)
        y = self.quant_method.apply(self, x, topk_weights, topk_ids)
        return self.tp.all_reduce(y) if self.reduce_results else y

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def uses_triton(self, x: torch.Tensor) -> bool:
        """auto: the Triton kernels on CUDA, vectorised torch on CPU."""
        return self.backend == "triton" or (self.backend == "auto" and x.is_cuda)

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
