"""Mixtral: Llama attention; every layer a sparse MoE block (softmax top-2 of 8, always
renormalised), experts' gate/up/down stored as w1/w3/w2 under `block_sparse_moe`."""

from stage_worker.models.base import CausalLM
from stage_worker.models.moe import MoeDecoderLayer


class MixtralDecoderLayer(MoeDecoderLayer):
    expert_checkpoint_names = ("w1", "w3", "w2")


class MixtralForCausalLM(CausalLM):
    decoder_layer = MixtralDecoderLayer
    checkpoint_renames = {"mlp": "block_sparse_moe"}
