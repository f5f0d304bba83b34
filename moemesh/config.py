"""The project's own model config, converted once from a Hugging Face `config.json`.

Real checkpoints spell the same thing several ways (top-level `rope_theta` + `rope_scaling` on the
hub, `rope_parameters` from transformers 5.x; `num_experts` or `num_local_experts`); this module is
the one place that knows the spellings. Everything downstream reads `ModelConfig`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# model_type -> the architecture name in config.json's `architectures`
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A checkpoint or flag the system cannot run, with a message meant for the user."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False
    # mixture of experts (num_experts == 0: dense model)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # tokens and storage
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"
    quantization: str | None = None  # the checkpoint's quantization_config["quant_method"], e.g. "fp8"
    quantization_config: tuple[tuple[str, object], ...] = ()  # the rest of it, as items (frozen)

    @property
    def architecture(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.model_type]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` uses the MoE block (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        eos = _eos_ids(raw, Path(model_dir) / "generation_config.json")
        return cls.from_hf(raw, eos_token_ids=eos)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], eos_token_ids: tuple[int, ...] | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            arch = (raw.get("architectures") or [model_type])[0]
            supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise ConfigError(f"unsupported architecture {arch!r} (model_type {model_type!r}); supported: {supported}")
        try:
            return cls._from_hf(model_type, raw, eos_token_ids)
        except KeyError as e:
            raise ConfigError(f"config.json of a {model_type} model lacks required field {e.args[0]!r}") from None

    @classmethod
    def _from_hf(cls, model_type: str, raw: dict[str, Any], eos_token_ids) -> "ModelConfig":
        hidden = raw["hidden_size"]
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or hidden // heads
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mixtral") else None
        if sliding is not None and sliding < raw.get("max_position_embeddings", 0):
            raise ConfigError(f"sliding_window={sliding} attention is not supported")

        num_experts = raw.get("num_local_experts", raw.get("num_experts", 0)) or 0
        if model_type == "llama":
            num_experts = 0
        moe = {}
        if num_experts:
            moe = dict(
                num_experts=num_experts,
                top_k=raw["num_experts_per_tok"],
                # Mixtral's experts use `intermediate_size`; Qwen MoE has a separate field.
                moe_intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
                # Mixtral always renormalises the top-k weights; Qwen says so in its config.
                norm_topk_prob=True if model_type == "mixtral" else bool(raw.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0) or 0,
                decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            )
        attention_bias = bool(raw.get("attention_bias", False))
        if eos_token_ids is None:
            eos_token_ids = _as_tuple(raw.get("eos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_rope_config(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2_moe" else attention_bias,
            o_bias=attention_bias if model_type in ("llama", "qwen3_moe") else False,
            qk_norm=model_type == "qwen3_moe",
            mlp_bias=bool(raw.get("mlp_bias", False)) if model_type == "llama" else False,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            checkpoint_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            quantization=(raw.get("quantization_config") or {}).get("quant_method"),
            quantization_config=tuple(sorted(_frozen((raw.get("quantization_config") or {})).items())),
            **moe,
        )


def _frozen(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, list) else (int(x),)


def _eos_ids(raw: dict, generation_config: Path) -> tuple[int, ...]:
    eos = set(_as_tuple(raw.get("eos_token_id")))
    if generation_config.is_file():
        eos |= set(_as_tuple(json.loads(generation_config.read_text()).get("eos_token_id")))
    return tuple(sorted(eos))


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5.x: rope_parameters {rope_theta, rope_type, ...}; the hub: rope_theta + rope_scaling
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def check_layout(model: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """Refuses a tensor-parallel layout the model cannot take, before anything loads weights."""
    problems = []
    if model.num_heads % tp:
        problems.append(f"{model.num_heads} attention heads")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        problems.append(f"{model.num_kv_heads} key/value heads (neither divides the other)")
    dense = [i for i in range(model.num_layers) if not model.is_sparse_layer(i)]
    if dense and model.intermediate_size % tp:
        problems.append(f"intermediate_size {model.intermediate_size}")
    if model.num_experts:
        if expert_parallel and model.num_experts % tp:
            problems.append(f"{model.num_experts} experts (with --expert-parallel)")
        if not expert_parallel and model.moe_intermediate_size % tp:
            problems.append(f"expert intermediate size {model.moe_intermediate_size}")
        if model.shared_expert_intermediate_size % tp:
            problems.append(f"shared expert intermediate size {model.shared_expert_intermediate_size}")
    elif expert_parallel:
        raise ConfigError(f"--expert-parallel needs a mixture-of-experts model; {model.architecture} is dense")
    if problems:
        raise ConfigError(f"--tp {tp} does not divide the model's " + ", ".join(problems))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(flag: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """`--dtype auto`: float32 on CPU (bf16 matmul is half speed there), the checkpoint's dtype on GPU."""
    if flag == "auto":
        return DTYPES.get(model.checkpoint_dtype, torch.float32) if device.type == "cuda" else torch.float32
    if flag not in DTYPES:
        raise ConfigError(f"--dtype {flag!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[flag]


def decode_costs(model: ModelConfig) -> tuple[list[float], float]:
    """(cost of each decoder layer, cost of the head) for one decode token, in multiply-adds of the
    weights that token uses: attention's projections and, per layer, its K routed experts plus any
    shared expert and router (sparse) or its dense MLP; the head is the final norm and lm_head. A
    decode step reads and multiplies these weights, so its time on a stage follows their sum (the
    attention over the cache is small beside them at the context lengths that serve decode)."""
    H = model.hidden_size
    attn = H * (model.q_size + 2 * model.kv_size) + model.q_size * H
    layers = []
    for i in range(model.num_layers):
        if model.is_sparse_layer(i):
            mlp = model.top_k * 3 * H * model.moe_intermediate_size + model.num_experts * H
            if model.shared_expert_intermediate_size:
                mlp += 3 * H * model.shared_expert_intermediate_size + H
        else:
            mlp = 3 * H * model.intermediate_size
        layers.append(float(attn + mlp))
    return layers, float(model.vocab_size * H)


def balanced_partition(model: ModelConfig, pp: int) -> tuple[int, ...]:
    """`--layer-partition auto`: layers per stage (contiguous, at least one each) that minimise the
    largest stage's decode cost (`decode_costs`; the last stage also carries the head), so that the
    stages of a pipeline are equally busy."""
    layers, head = decode_costs(model)
    n = len(layers)
    if not 1 <= pp <= n:
        raise ConfigError(f"--pp {pp} must be between 1 and the model's {n} layers")
    prefix = [0.0]
    for c in layers:
        prefix.append(prefix[-1] + c)
    cost = lambda a, b, last: prefix[b] - prefix[a] + (head if last else 0.0)  # noqa: E731
    # best[s][j]: the least possible largest stage cost of layers 0..j-1 split into s stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(i, j, s == pp and j == n))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    counts, j = [], n
    for s in range(pp, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return tuple(reversed(counts))
