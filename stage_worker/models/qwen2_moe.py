"""Qwen2-MoE: attention with q/k/v biases; sparse layers per `decoder_sparse_step` /
`mlp_only_layers`; routed experts (renormalised only if `norm_topk_prob`) plus a shared expert
scaled by a sigmoid gate. All of it is config-driven in the shared blocks."""

from stage_worker.models.base import CausalLM
from stage_worker.models.moe import MoeDecoderLayer


class Qwen2MoeForCausalLM(CausalLM):
    decoder_layer = MoeDecoderLayer
