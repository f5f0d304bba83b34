"""The sparse MoE block shared by Mixtral, Qwen2-MoE and Qwen3-MoE, and their decoder layer.

Legend: T = tokens, H = hidden, E = experts, K = experts per token.

    router_logits = gate(x)                              [T, E]   (never quantized)
    y = experts(x, router_logits)                        [T, H]   softmax top-K (renormalised if the
                                                                   config says so), SiLU experts
    y += sigmoid(shared_expert_gate(x)) * shared(x)      [T, H]   Qwen2-MoE only
    all-reduce y across the stage's tensor ranks (once, after both)

Which layers are sparse follows the config (`decoder_sparse_step`, `mlp_only_layers`); the others
use Llama's dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.config import ModelConfig
from stage_worker.layers.fused_moe import FusedMoE
from stage_worker.layers.linear import ReplicatedLinear
from stage_worker.layers.parallel import TPGroup
from stage_worker.models.llama import LlamaDecoderLayer, LlamaMLP


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, quant, expert_checkpoint_names: tuple[str, str, str]):
        super().__init__()
        self.tp = tp
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.top_k, config.hidden_size, config.moe_intermediate_size,
                                renormalize=config.norm_topk_prob, tp=tp, quant=quant, reduce_results=False,
                                checkpoint_names=expert_checkpoint_names)
        self.shared_expert = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config.hidden_size, config.shared_expert_intermediate_size, False, tp, quant,
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(y)


class MoeDecoderLayer(LlamaDecoderLayer):
    expert_checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_idx: int, tp: TPGroup, quant) -> nn.Module:
        if config.is_sparse_layer(layer_idx):
            return SparseMoeBlock(config, tp, quant, cls.expert_checkpoint_names)
        return super().make_mlp(config, layer_idx, tp, quant)
