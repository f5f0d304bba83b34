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

from moemesh.errors import ConfigError

# model_type -> the architecture name in config.json's `architectures`
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
            raise ConfigError(f"--model {model_dir}: no config.json there (not a model directory)")
        raw = read_json_object(path)
        eos = _eos_ids(raw, Path(model_dir) / "generation_config.json")
        return cls.from_hf(raw, eos_token_ids=eos)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], eos_token_ids: tuple[int, ...] | None = None) -> "ModelConfig":
        model_type = raw.get("model_type")
        if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
            archs = raw.get("architectures")
            arch = archs[0] if isinstance(archs, list) and archs else model_type
            supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise ConfigError(f"unsupported architecture {arch!r} (model_type {model_type!r}); supported: {supported}")
        try:
            config = cls._from_hf(model_type, raw, eos_token_ids)
        except KeyError as e:
            raise ConfigError(f"config.json of a {model_type} model lacks required field {e.args[0]!r}") from None
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
            raise ConfigError(f"config.json of a {model_type} model has a field of the wrong type: {e}") from None
        sizes = [("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
                 ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
                 ("head_dim", "head_dim"), ("max_position_embeddings", "max_position_embeddings"),
                 ("intermediate_size", "intermediate_size")]
        if config.num_experts:
            sizes += [("num_experts", "num_local_experts" if model_type == "mixtral" else "num_experts"),
                      ("moe_intermediate_size", "moe_intermediate_size")]
        for name, hf_name in sizes:
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config.json of a {model_type} model: {hf_name} is {value!r}, not a positive "
                                  f"integer")
        if config.num_heads % config.num_kv_heads:
            raise ConfigError(f"config.json of a {model_type} model: num_attention_heads {config.num_heads} is not a "
                              f"multiple of num_key_value_heads {config.num_kv_heads}")
        eps = config.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            raise ConfigError(f"config.json of a {model_type} model: rms_norm_eps is {eps!r}, not a number in [0, 1)")
        return config

    @classmethod
    def _from_hf(cls, model_type: str, raw: dict[str, Any], eos_token_ids) -> "ModelConfig":
        hidden = raw["hidden_size"]
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or (hidden // heads if isinstance(heads, int) and heads > 0 else None)
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mixtral") else None
        if sliding is not None and sliding < raw.get("max_position_embeddings",
                                                      HF_DEFAULTS[model_type]["max_position_embeddings"]):
            raise ConfigError(f"sliding_window={sliding} attention is not supported")

        defaults = HF_DEFAULTS[model_type]  # (what transformers fills in for a field config.json leaves out)
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
                shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size",
                                                        defaults.get("shared_expert_intermediate_size", 0)) or 0,
                decoder_sparse_step=raw.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            )
            step, dense = moe["decoder_sparse_step"], raw.get("mlp_only_layers") or []
            if not isinstance(step, int) or isinstance(step, bool) or step < 1:
                raise ConfigError(f"decoder_sparse_step={step!r} must be a positive integer")
            if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
                raise ConfigError(f"mlp_only_layers={dense!r} must be a list of layer indices")
            if not isinstance(moe["top_k"], int) or not 1 <= moe["top_k"] <= num_experts:
                raise ConfigError(f"num_experts_per_tok={moe['top_k']!r} must be between 1 and the "
                                  f"{num_experts} experts")
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
            rms_norm_eps=raw.get("rms_norm_eps", defaults["rms_norm_eps"]),
            rope=_rope_config(raw, defaults["rope_theta"]),
            max_position_embeddings=raw.get("max_position_embeddings", defaults["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # (Qwen2-MoE's own switch; transformers' Mixtral has no attention biases at all)
            qkv_bias=bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else
            (attention_bias and model_type != "mixtral"),
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
    ids = x if isinstance(x, list) else [x]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"{x!r} is not a token id or a list of them")
    return tuple(ids)


# generation_config.json's sampling settings that become request defaults (as vLLM's --generation-config
# auto takes them), by their SamplingParams names
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | Path) -> dict:
    """The sampling defaults the checkpoint recommends (its generation_config.json), by SamplingParams
    field; ConfigError naming the file for one that is not a valid setting."""
    import msgspec

    from moemesh.sampling import SamplingParams

    path = Path(model_dir) / "generation_config.json"
    raw = read_json_object(path) if path.is_file() else {}
    found = {ours: raw[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if raw.get(theirs) is not None}
    top_k = found.get("top_k")
    if isinstance(top_k, float) and top_k.is_integer():
        found["top_k"] = int(top_k)  # (20.0: as transformers reads it)
    if found.get("top_k") == -1:
        found["top_k"] = 0  # (-1: off, as vLLM spells it)
    try:
        msgspec.convert(found, SamplingParams)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{path}: {e}") from None
    return found


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file (config, generation or tokenizer config): ConfigError naming it if it
    cannot be read or is not a JSON object."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return raw


def _eos_ids(raw: dict, generation_config: Path) -> tuple[int, ...]:
    try:
        eos = set(_as_tuple(raw.get("eos_token_id")))
        if generation_config.is_file():
            eos |= set(_as_tuple(read_json_object(generation_config).get("eos_token_id")))
        return tuple(sorted(eos))
    except (TypeError, ValueError) as e:  # (an id that is not a number)
        raise ConfigError(f"eos_token_id of {generation_config.parent}: {e}") from None


# transformers' defaults for fields a config.json may leave out, by architecture (its config classes')
HF_DEFAULTS = {
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32},
    "qwen2_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "llama": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
}


def _rope_config(raw: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    # transformers 5.x: rope_parameters {rope_theta, rope_type, ...}; the hub: rope_theta + rope_scaling
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1 < theta < float("inf"):
        raise ConfigError(f"rope_theta={theta!r} must be a finite number above 1")  # (nan: every logit nan)
    rope = RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )
    if rope.original_max_position_embeddings < 1 and "original_max_position_embeddings" not in params:
        raise ConfigError(f"config.json: max_position_embeddings is {raw.get('max_position_embeddings')!r}, not a "
                          f"positive integer")
    if not 0 < rope.factor < float("inf") or rope.original_max_position_embeddings < 1:
        raise ConfigError(f"rope scaling factor {rope.factor!r} and original_max_position_embeddings "
                          f"{rope.original_max_position_embeddings!r} must be positive")
    if rope_type == "llama3" and not 0 < rope.low_freq_factor < rope.high_freq_factor:
        raise ConfigError(f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, not "
                          f"{rope.low_freq_factor!r} and {rope.high_freq_factor!r}")
    return rope


DTYPES = ("float32", "bfloat16", "float16")  # compute dtypes, by name (stage_worker.tensors maps them to torch)


def resolve_dtype(flag: str, model: ModelConfig, device: str = "cpu") -> str:
    """`--dtype auto`: float32 on CPU (the dtype whose greedy output equals transformers' token for token;
    `--dtype bfloat16` reads half the bytes a step, and multiplies faster on a CPU with AVX512-BF16:
    docs/benchmarks.md), the checkpoint's dtype on GPU."""
    if flag == "auto":
        on_gpu = device.startswith("cuda")
        return model.checkpoint_dtype if on_gpu and model.checkpoint_dtype in DTYPES else "float32"
    if flag not in DTYPES:
        raise ConfigError(f"--dtype {flag!r} is not one of auto, {', '.join(DTYPES)}")
    return flag


QUANTIZATIONS = ("fp8", "int8")
MOE_BACKENDS = ("auto", "torch", "native", "triton")  # moemesh_kernels.backend.resolve_backend says what each means


def check_quantization(model: ModelConfig, flag: str | None) -> str | None:
    """The quantization a model runs with: the checkpoint's own (an AutoFP8 checkpoint), or `flag`
    ("fp8": quantize 16/32-bit weights at load; "int8": weight-only int8, per-row scales), or None.
    Refuses, before anything loads, what cannot run; the workers build the method from the answer
    (stage_worker.layers.fp8.resolve_quantization)."""
    if flag is not None and flag not in QUANTIZATIONS:
        raise ConfigError(f"--quantization {flag!r} is not one of {', '.join(QUANTIZATIONS)}")
    if flag == "int8" and model.quantization is not None:
        raise ConfigError(f"--quantization int8 needs a 16/32-bit checkpoint; this one is already {model.quantization}")
    if model.quantization is not None:
        config = dict(model.quantization_config)
        check_fp8_checkpoint(config)
        odd = [n for n in config.get("ignored_layers") or () if n != "lm_head" and not n.endswith(_NEVER_QUANTIZED)]
        if odd:
            raise ConfigError(f"ignored_layers {odd[:3]} of this FP8 checkpoint name layers moemesh would quantize; "
                              "only lm_head and router gates can be left out")
        return model.quantization
    return flag


_NEVER_QUANTIZED = (".gate", ".shared_expert_gate")  # router gates: never quantized anyway


def check_fp8_checkpoint(quantization_config: dict) -> None:
    """config.json's `quantization_config` as AutoFP8 writes it: {"quant_method": "fp8",
    "activation_scheme": "dynamic" | "static", "ignored_layers": [...]}; another method or format is
    refused (which layers a checkpoint may leave out is `check_quantization`'s business)."""
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization method {method!r} is not supported (only fp8, per tensor)")
    if quantization_config.get("weight_block_size") is not None:
        raise ConfigError(f"block-wise FP8 (weight_block_size={quantization_config['weight_block_size']}) "
                          "is not supported; only per-tensor scales")
    if quantization_config.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"FP8 format {quantization_config['fmt']!r} is not supported (only e4m3)")
    scheme = quantization_config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"FP8 activation_scheme {scheme!r} is not one of dynamic, static")
