"""Qwen3-MoE: Qwen2-MoE without the shared expert and q/k biases, with per-head RMSNorm on q and k
(`q_norm`, `k_norm`) and a head_dim that need not be hidden / heads. All config-driven."""

from stage_worker.models.base import CausalLM
from stage_worker.models.moe import MoeDecoderLayer


class Qwen3MoeForCausalLM(CausalLM):
    decoder_layer = MoeDecoderLayer
