"""Tiny Hugging Face reference checkpoints, built and saved by transformers itself (offline).

The weights are re-drawn with larger variance than transformers' init (std 0.02), so that logits
are well separated and greedy parity tests compare real decisions, not near-ties.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=0, pad_token_id=0)

ARCH_CONFIGS = {
    "mixtral": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2_moe": dict(intermediate_size=128, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3_moe": dict(intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
                      norm_topk_prob=True, decoder_sparse_step=2, head_dim=24,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "llama": dict(intermediate_size=160, attention_bias=True, mlp_bias=False, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
}


def hf_config(arch: str, **overrides):
    from transformers import AutoConfig

    kwargs = {**COMMON, **ARCH_CONFIGS[arch], **overrides}
    return AutoConfig.for_model(arch, **kwargs)


def reinit_(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                scale = 2.0 if name.endswith("gate.weight") else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def build_hf_model(arch: str, out_dir: Path | None = None, seed: int = 0, max_shard_size=None, **overrides):
    """An HF model in float32 eager mode (and its saved checkpoint in out_dir, if given)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    reinit_(model, seed)
    model.eval()
    if out_dir is not None:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(out_dir, **kwargs)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' model and KV cache, EOS ignored (as `ignore_eos` does):
    generate() either stops at EOS or, with min_new_tokens, suppresses it."""
    tokens = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()
