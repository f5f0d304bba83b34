"""Llama (dense). Its attention block serves every model here: q/k/v biases, q/k norms and head_dim
come from the config (Qwen2-MoE has q/k/v biases, Qwen3-MoE per-head q/k RMSNorm).

Legend: T = tokens, H = hidden, h / kvh = query / kv heads on this rank, D = head_dim, I = intermediate.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.config import ModelConfig
from stage_worker.layers.activation import silu_and_mul
from stage_worker.layers.attention import PagedAttention
from stage_worker.layers.layernorm import RMSNorm
from stage_worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from stage_worker.layers.parallel import TPGroup
from stage_worker.layers.rotary import RotaryEmbedding
from stage_worker.context import get_context
from stage_worker.models.base import CausalLM


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, quant=None):
        super().__init__()
        D = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, D, config.num_heads, config.num_kv_heads,
                                          config.qkv_bias, tp, quant)
        self.o_proj = RowParallelLinear(config.num_heads * D, config.hidden_size, config.o_bias, tp, quant)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, D
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary_emb = RotaryEmbedding(D, config.rope, config.max_position_embeddings)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [T, (h + 2 kvh) D]
        q, k, v = qkv.split([self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        q, k, v = q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(get_context().positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, H]


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TPGroup, quant=None,
                 reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp, quant)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, quant,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, H] -> [T, 2I] -> [T, I] -> [T, H]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup, quant=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, tp, quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer_idx, tp, quant)

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_idx: int, tp: TPGroup, quant) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp, quant)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, mlp: bool = True):
        """mlp=False stops after the attention (the MLP hand-off: the next stage runs this layer's MLP,
        `models.base.HandoffMLP`): hidden + residual is then the residual stream after the attention."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x)
        if not mlp:
            return x, residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    decoder_layer = LlamaDecoderLayer
