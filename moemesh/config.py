"""The project's own model config, converted once from a Hugging Face `config.json`.

Real checkpoints spell the same thing several ways (top-level `rope_theta` + `rope_scaling` on the
hub, `rope_parameters` from transformers 5.x; `num_experts` or `num_local_experts`); this module is
the one place that knows the spellings. Everything downstream reads `ModelConfig`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
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

    def to_json(self) -> str:
        """Every field as JSON: what a stage worker says it loaded (`differences` reads it)."""
        return json.dumps(asdict(self), sort_keys=True)

    def differences(self, loaded: str) -> list[str]:
        """The fields in which the config `loaded` (another's to_json) differs from this one, each as
        "name: theirs there, ours here"; [] where they agree. ConfigError for what is not such JSON."""
        try:
            theirs = json.loads(loaded)
        except ValueError as e:
            raise ConfigError(f"not a model config: {e}") from None
        if not isinstance(theirs, dict):
            raise ConfigError("not a model config: not an object")
        ours = json.loads(self.to_json())
        # (the fields both know: a field one version adds is not a difference between checkpoints)
        return [f"{name}: {theirs[name]!r} there, {ours[name]!r} here"
                for name in sorted(set(ours) & set(theirs)) if theirs[name] != ours[name]]

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
        if model_type is None:
            archs = raw.get("architectures")
            implied = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(archs[0]) \
                if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
            raise ConfigError("config.json has no model_type" + (f" (its architectures say {implied!r}: add "
                                                                  f'"model_type": "{implied}")' if implied else ""))
        if not isinstance(model_type, str) or model_type not in SUPPORTED_ARCHITECTURES:
            archs = raw.get("architectures")
            arch = archs[0] if isinstance(archs, list) and archs else model_type
            supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise ConfigError(f"unsupported architecture {arch!r} (model_type {model_type!r}); supported: {supported}")
        try:
            config = cls._from_hf(model_type, _Fields(raw), eos_token_ids)
        except ConfigError as e:
            raise ConfigError(f"config.json of a {model_type} model: {e}") from None
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # (what the readers do not foresee)
            raise ConfigError(f"config.json of a {model_type} model has a field of the wrong type: {e}") from None
        if config.num_heads % config.num_kv_heads:
            raise ConfigError(f"config.json of a {model_type} model: num_attention_heads {config.num_heads} is not a "
                              f"multiple of num_key_value_heads {config.num_kv_heads}")
        return config

    @classmethod
    def _from_hf(cls, model_type: str, raw: "_Fields", eos_token_ids) -> "ModelConfig":
        defaults = HF_DEFAULTS[model_type]  # (what transformers fills in for a field config.json leaves out)
        hidden = raw.int("hidden_size")
        heads = raw.int("num_attention_heads")
        head_dim = raw.int("head_dim", hidden // heads)
        if head_dim < 1:  # (left out: hidden_size // num_attention_heads, as transformers derives it)
            raise ConfigError(f"hidden_size {hidden} is smaller than num_attention_heads {heads} (and there is no "
                              f"head_dim)")
        if head_dim % 2:  # (rotary embeddings turn a head's dimensions in pairs)
            raise ConfigError(f"head_dim {head_dim} is odd: rotary embeddings need an even head size")
        if raw.str("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        # (a context length bounds no allocation: the rotary tables stop at what the KV cache holds; 8192.0
        # reads as 8192, as transformers takes it)
        max_positions = raw.int("max_position_embeddings", defaults["max_position_embeddings"], maximum=MAX_POSITIONS,
                                integral_float=True)
        # Mixtral's attention slides wherever sliding_window is set (it has no use_sliding_window); the
        # Qwen MoE models' where use_sliding_window says so, 4096 wide unless sliding_window says
        # otherwise (null: no window)
        if model_type == "mixtral":
            sliding = raw.int("sliding_window", None)
        elif raw.bool("use_sliding_window", False) and not ("sliding_window" in raw and raw["sliding_window"] is None):
            sliding = raw.int("sliding_window", defaults["sliding_window"])
        else:
            sliding = None
        if sliding is not None and sliding < max_positions:
            raise ConfigError(f"sliding_window={sliding} attention is not supported" +
                              ("" if model_type == "mixtral" else " (use_sliding_window is true)"))

        intermediate = raw.int("intermediate_size")
        num_experts = 0
        if model_type != "llama":
            # (transformers' Mixtral and Qwen3-MoE take either name; Qwen2-MoE only num_experts)
            name = "num_local_experts" if "num_local_experts" in raw and model_type != "qwen2_moe" else "num_experts"
            num_experts = raw.int(name, defaults["num_experts"], minimum=0)
        moe = {}
        if num_experts:
            top_k = raw.get("num_experts_per_tok")
            top_k = defaults["num_experts_per_tok"] if top_k is None else top_k
            if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
                raise ConfigError(f"num_experts_per_tok={top_k!r} must be between 1 and the {num_experts} experts")
            qwen = model_type != "mixtral"  # (fields transformers' Mixtral does not read)
            moe = dict(
                num_experts=num_experts,
                top_k=top_k,
                # Mixtral's experts use `intermediate_size`; Qwen MoE has a separate field.
                moe_intermediate_size=(raw.int("moe_intermediate_size", defaults["moe_intermediate_size"])
                                       if qwen else intermediate),
                # Mixtral always renormalises the top-k weights; Qwen says so in its config.
                norm_topk_prob=raw.bool("norm_topk_prob", False) if qwen else True,
                # (Qwen3-MoE has no shared expert)
                shared_expert_intermediate_size=(raw.int("shared_expert_intermediate_size",
                                                         defaults["shared_expert_intermediate_size"], minimum=0)
                                                 if model_type == "qwen2_moe" else 0),
                # (0 reads as 1: every layer sparse)
                decoder_sparse_step=(raw.int("decoder_sparse_step", 1, minimum=0) or 1) if qwen else 1,
                mlp_only_layers=raw.ints("mlp_only_layers") if qwen else (),
            )
        # (left out: the architecture's default; null: one per attention head, as transformers fills in)
        kv_default = heads if "num_key_value_heads" in raw else defaults["num_key_value_heads"] or heads
        num_kv_heads = raw.int("num_key_value_heads", kv_default)
        attention_bias = raw.bool("attention_bias", False)
        if eos_token_ids is None:
            eos_token_ids = _as_tuple(raw.get("eos_token_id"))
        quantization = raw.object("quantization_config")
        method = quantization.get("quant_method")
        if method is not None and not isinstance(method, str):
            raise ConfigError(f"quantization_config.quant_method is {method!r}, not a name")
        return cls(
            model_type=model_type,
            vocab_size=raw.int("vocab_size"),
            hidden_size=hidden,
            num_layers=raw.int("num_hidden_layers", maximum=MAX_LAYERS),
            num_heads=heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            rms_norm_eps=raw.eps("rms_norm_eps", defaults["rms_norm_eps"]),
            rope=_rope_config(raw, defaults["rope_theta"], max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=raw.bool("tie_word_embeddings", False),
            # (Qwen2-MoE's own switch; transformers' Mixtral has no attention biases at all)
            qkv_bias=raw.bool("qkv_bias", True) if model_type == "qwen2_moe" else
            (attention_bias and model_type != "mixtral"),
            o_bias=attention_bias if model_type in ("llama", "qwen3_moe") else False,
            qk_norm=model_type == "qwen3_moe",
            mlp_bias=raw.bool("mlp_bias", False) if model_type == "llama" else False,
            bos_token_id=raw.int("bos_token_id", None, minimum=0),
            eos_token_ids=eos_token_ids,
            checkpoint_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            quantization=method,
            quantization_config=tuple(sorted(_frozen(quantization).items())),
            **moe,
        )


# the largest size a config.json may give (the kernels index with 32-bit integers), the most layers, and the
# largest context length (a C long's)
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 1 << 16
MAX_POSITIONS = 2**63 - 1
_REQUIRED = object()


class _Fields:
    """config.json's object, read field by field: each reader checks its field's type and range and
    raises ConfigError naming the field (after `prefix`, for an object inside it: "rope_scaling."). A
    field left out, or null, takes the default given (transformers' own); without a default it is
    required."""

    def __init__(self, raw: dict[str, Any], prefix: str = ""):
        self.raw, self.prefix = raw, prefix

    def __contains__(self, name: str) -> bool:
        return name in self.raw

    def __getitem__(self, name: str):
        return self.raw[name]

    def get(self, name: str, default=None):
        return self.raw.get(name, default)

    def _value(self, name: str, default):
        """(the field's value, True), or (default, False) where it is left out or null."""
        value = self.raw.get(name)
        if value is not None:
            return value, True
        if default is _REQUIRED:
            raise ConfigError(f"required field {self.prefix + name!r} is {'null' if name in self.raw else 'missing'}")
        return default, False

    def int(self, name: str, default=_REQUIRED, minimum: int = 1, maximum: int = MAX_SIZE,
            integral_float: bool = False):
        value, given = self._value(name, default)
        if not given:
            return value
        if integral_float and isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
            raise ConfigError(f"{self.prefix}{name} is {value!r}, not {kind}")
        if value > maximum:
            raise ConfigError(f"{self.prefix}{name} is {value!r}, more than the {maximum:,} moemesh takes")
        return value

    def ints(self, name: str) -> tuple[int, ...]:
        value, _ = self._value(name, [])
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise ConfigError(f"{self.prefix}{name}={value!r} must be a list of layer indices")
        return tuple(value)

    def bool(self, name: str, default: bool) -> bool:
        value, _ = self._value(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.prefix}{name} is {value!r}, not true or false")
        return value

    def str(self, name: str, default: str) -> str:
        value, _ = self._value(name, default)
        if not isinstance(value, str):
            raise ConfigError(f"{self.prefix}{name} is {value!r}, not a name")
        return value

    def number(self, name: str, default: float) -> float:
        value, _ = self._value(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self.prefix}{name} is {value!r}, not a number")
        return float(value)

    def eps(self, name: str, default: float) -> float:
        eps = self.number(name, default)
        if not 0 <= eps < 1:
            raise ConfigError(f"{self.prefix}{name} is {eps!r}, not a number in [0, 1)")
        return eps

    def object(self, name: str) -> dict:
        value, _ = self._value(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"{self.prefix}{name} is {value!r}, not an object")
        return value


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
# (num_key_value_heads None: one per attention head)
HF_DEFAULTS = {
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32,
                "num_key_value_heads": 8, "num_experts": 8, "num_experts_per_tok": 2},
    "qwen2_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "sliding_window": 4096},
    "qwen3_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                  "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "sliding_window": 4096},
    "llama": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "num_key_value_heads": None},
}


def _rope_config(raw: "_Fields", default_theta: float, max_positions: int) -> RopeConfig:
    # transformers 5.x: rope_parameters {rope_theta, rope_type, ...}; the hub: rope_theta + rope_scaling. A
    # rope_scaling given (a model card's recipe added to a saved config) replaces rope_parameters whole, as
    # transformers takes it
    scaling_given = raw.object("rope_scaling")
    params = dict(scaling_given or raw.object("rope_parameters"))
    where = "rope_scaling" if scaling_given else "rope_parameters"
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 1 < theta < float("inf"):
        raise ConfigError(f"rope_theta={theta!r} must be a finite number above 1")  # (nan: every logit nan)
    scaling = _Fields(params, f"{where}.")
    rope = RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=scaling.number("factor", 1.0),
        low_freq_factor=scaling.number("low_freq_factor", 1.0),
        high_freq_factor=scaling.number("high_freq_factor", 4.0),
        # (8192.0 reads as 8192, as transformers takes it)
        original_max_position_embeddings=scaling.int("original_max_position_embeddings", max_positions,
                                                     maximum=MAX_POSITIONS, integral_float=True),
    )
    if not 0 < rope.factor < float("inf"):
        raise ConfigError(f"rope scaling factor {rope.factor!r} must be positive")
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
