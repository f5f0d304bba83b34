"""Tiny random checkpoints in the Hugging Face hub layout, written without transformers.

`write_tiny_model(spec, out_dir)` writes what `save_pretrained` plus a tokenizer would put in a hub
repo: config.json, generation_config.json, model.safetensors (or shards + index), tokenizer.json,
tokenizer_config.json and special_tokens_map.json. Tests and benchmarks use it, since nothing can be
downloaded here; the trained demo model (train_demo.py) reuses its config and tokenizer writers.

Hub spellings are used on purpose (they are what real checkpoints carry): top-level `rope_theta`
with `rope_scaling: null` rather than 5.x's `rope_parameters`, `num_experts` for Qwen3-MoE rather
than the `num_local_experts` that transformers 5.x writes, `torch_dtype` rather than `dtype`, and
per-expert 2-D weights (`experts.E.w1.weight`) rather than the fused 3-D tensors transformers keeps
in memory.

Initialisation is deliberately far from Hugging Face's std 0.02 (which gives nearly uniform logits):
linear weights N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2),
routers N(0, (2/sqrt(H))^2), so greedy outputs vary and logits are well separated. Everything is drawn
in float32 from one seeded torch.Generator, then cast to `spec.dtype`: same spec, same bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from moemesh.config import DTYPES, MAX_LAYERS, MAX_SIZE, SUPPORTED_ARCHITECTURES

ARCHS = tuple(SUPPORTED_ARCHITECTURES)

# Special tokens take ids 0..3, in this order.
ENDOFTEXT, BOS, IM_START, IM_END = "<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, BOS, IM_START, IM_END)
ENDOFTEXT_ID, BOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3
MIN_VOCAB_SIZE = 300  # 4 special tokens + the 256-symbol byte-level alphabet + a few merges

# Qwen-style ChatML, without Qwen's default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str
    num_layers: int = 4
    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLP (llama, qwen dense layers) and Mixtral's experts
    moe_intermediate_size: int = 64  # qwen2_moe / qwen3_moe experts
    shared_expert_intermediate_size: int = 128  # qwen2_moe only
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None -> hidden_size // num_heads
    num_experts: int = 8
    top_k: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    norm_topk_prob: bool | None = None  # None -> qwen3_moe True, qwen2_moe False; mixtral always renormalises
    decoder_sparse_step: int = 1  # qwen2_moe / qwen3_moe
    mlp_only_layers: tuple[int, ...] = ()  # qwen2_moe / qwen3_moe: layers with a dense MLP
    seed: int = 0
    dtype: str = "float32"  # float32 | bfloat16 | float16
    max_shard_bytes: int | None = None  # None -> one model.safetensors

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_heads",
                     "num_kv_heads", "num_experts", "top_k", "max_position_embeddings", "vocab_size",
                     "shared_expert_intermediate_size"):
            value, most = getattr(self, name), MAX_LAYERS if name == "num_layers" else MAX_SIZE
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            if value > most:
                raise ValueError(f"{name} must be at most {most:,}, got {value:,}")
        if self.head_dim is not None and not 1 <= self.head_dim <= MAX_SIZE:
            raise ValueError(f"head_dim must be between 1 and {MAX_SIZE:,}, got {self.head_dim}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} is not one of {ARCHS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {tuple(DTYPES)}")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {self.vocab_size}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads unless head_dim is given")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        if (self.head_dim or self.hidden_size // self.num_heads) % 2:  # (every loader refuses it)
            raise ValueError(f"head_dim (hidden_size / num_heads unless given) must be even for rotary embeddings, "
                             f"got {self.head_dim or self.hidden_size // self.num_heads}")
        if self.is_moe and not 1 <= self.top_k <= self.num_experts:
            raise ValueError("need 1 <= top_k <= num_experts")
        if self.arch == "mixtral" and self.norm_topk_prob is False:
            raise ValueError("Mixtral always renormalises its top-k weights")
        if self.arch not in ("qwen2_moe", "qwen3_moe") and (self.mlp_only_layers or self.decoder_sparse_step != 1):
            raise ValueError("mlp_only_layers / decoder_sparse_step apply to qwen2_moe and qwen3_moe only")
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError("mlp_only_layers must index existing layers")
        if not 1 < self.rope_theta < float("inf"):  # (nan: every logit nan)
            raise ValueError(f"rope_theta must be a finite number above 1, got {self.rope_theta}")

    @property
    def is_moe(self) -> bool:
        return self.arch != "llama"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def expert_intermediate_size(self) -> int:
        return self.intermediate_size if self.arch == "mixtral" else self.moe_intermediate_size

    @property
    def resolved_norm_topk_prob(self) -> bool:
        if self.norm_topk_prob is not None:
            return self.norm_topk_prob
        return self.arch in ("mixtral", "qwen3_moe")

    def num_parameters(self) -> int:
        """The weights' count in `random_state_dict`, from the sizes alone (a test holds them equal)."""
        H, D, V, I = self.hidden_size, self.resolved_head_dim, self.vocab_size, self.expert_intermediate_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * D
        attention = qkv * H + H * self.num_heads * D + 2 * H  # (+ the two norms)
        attention += qkv if self.arch == "qwen2_moe" else 2 * D if self.arch == "qwen3_moe" else 0
        sparse = self.num_experts * (H + 3 * H * I)
        if self.arch == "qwen2_moe":
            sparse += 3 * H * self.shared_expert_intermediate_size + H
        dense = 3 * H * self.intermediate_size
        mlps = sum(sparse if self.is_sparse_layer(n) else dense for n in range(self.num_layers))
        return V * H + self.num_layers * attention + mlps + H + (0 if self.tie_word_embeddings else V * H)

    def is_sparse_layer(self, layer: int) -> bool:
        """Same rule as transformers' Qwen2-MoE / Qwen3-MoE decoder layer; every Mixtral layer is sparse."""
        if self.arch == "mixtral":
            return True
        if self.arch == "llama":
            return False
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


# Sizes for the benchmark model (matches the CPU baselines in FACTS.md) and `make-tiny-model --preset default`
# (the random model that was built in before the trained demo model, moemesh/demo_model).
BENCH_SPEC = TinyModelSpec(
    arch="mixtral", num_layers=8, hidden_size=512, intermediate_size=1024,
    num_heads=8, num_kv_heads=2, num_experts=8, top_k=2, vocab_size=32000,
)
DEFAULT_SPEC = TinyModelSpec(
    arch="mixtral", num_layers=4, hidden_size=256, intermediate_size=512,
    num_heads=8, num_kv_heads=2, num_experts=8, top_k=2, vocab_size=1024,
)


def write_tiny_model(spec: TinyModelSpec, out_dir: str | Path) -> Path:
    """Write a random checkpoint + tokenizer for `spec` into `out_dir` (created if needed); return it.
    ValueError, before anything is written, for a model whose weights this host could not hold."""
    from moemesh.settings import host_memory

    # (drawn in float32, then cast: both copies are held at once where the dtype differs)
    params = spec.num_parameters()
    need = params * (4 if spec.dtype == "float32" else 4 + 2)
    if need > host_memory():
        raise ValueError(f"a model of {params:,} parameters takes {need / 2**30:,.1f} GiB to write, more than this "
                         f"host's {host_memory() / 2**30:.1f} GiB of memory")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # an earlier checkpoint's shards there would be read with this one's
    _write_json(out_dir / "config.json", hf_config(spec))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BOS_ID,
        "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
        "pad_token_id": ENDOFTEXT_ID,
    })
    _write_weights(random_state_dict(spec), out_dir, spec.max_shard_bytes)
    write_tokenizer(out_dir, spec.vocab_size, model_max_length=spec.max_position_embeddings)
    return out_dir


def hf_config(spec: TinyModelSpec) -> dict:
    """config.json contents, with the field names of each transformers config class (hub spelling)."""
    cfg: dict = {
        "architectures": [SUPPORTED_ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": ENDOFTEXT_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": spec.dtype,
    }
    if spec.head_dim is not None or spec.arch in ("qwen3_moe", "llama"):
        cfg["head_dim"] = spec.resolved_head_dim
    if spec.arch == "mixtral":
        cfg.update(
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            sliding_window=None,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
    elif spec.arch in ("qwen2_moe", "qwen3_moe"):
        cfg.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=spec.decoder_sparse_step,
            mlp_only_layers=list(spec.mlp_only_layers),
            norm_topk_prob=spec.resolved_norm_topk_prob,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=spec.num_layers,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
        )
        if spec.arch == "qwen2_moe":
            cfg["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
        else:
            cfg["attention_bias"] = False
    else:  # llama
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return cfg


def random_state_dict(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Hub-named weights in module order, drawn in float32 from `spec.seed`, cast to `spec.dtype`."""
    import torch  # here, not at the top: the CLI builds its flags from TinyModelSpec without loading torch

    from stage_worker.tensors import torch_dtype

    gen = torch.Generator().manual_seed(spec.seed)
    H, D, V = spec.hidden_size, spec.resolved_head_dim, spec.vocab_size

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal((out_features, in_features), 1.0 / math.sqrt(in_features))

    def norm(size: int) -> torch.Tensor:
        return normal((size,), 0.1, mean=1.0)

    def mlp(prefix: str, inter: int, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
        gate, up, down = names
        return {
            f"{prefix}.{gate}.weight": linear(inter, H),
            f"{prefix}.{up}.weight": linear(inter, H),
            f"{prefix}.{down}.weight": linear(H, inter),
        }

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((V, H), 1.0)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}"
        sd[f"{p}.self_attn.q_proj.weight"] = linear(spec.num_heads * D, H)
        sd[f"{p}.self_attn.k_proj.weight"] = linear(spec.num_kv_heads * D, H)
        sd[f"{p}.self_attn.v_proj.weight"] = linear(spec.num_kv_heads * D, H)
        sd[f"{p}.self_attn.o_proj.weight"] = linear(H, spec.num_heads * D)
        if spec.arch == "qwen2_moe":
            sd[f"{p}.self_attn.q_proj.bias"] = normal((spec.num_heads * D,), 0.1)
            sd[f"{p}.self_attn.k_proj.bias"] = normal((spec.num_kv_heads * D,), 0.1)
            sd[f"{p}.self_attn.v_proj.bias"] = normal((spec.num_kv_heads * D,), 0.1)
        if spec.arch == "qwen3_moe":
            sd[f"{p}.self_attn.q_norm.weight"] = norm(D)
            sd[f"{p}.self_attn.k_norm.weight"] = norm(D)

        if spec.arch == "mixtral":
            moe, expert_names = f"{p}.block_sparse_moe", ("w1", "w3", "w2")  # gate, up, down
        else:
            moe, expert_names = f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")
        if spec.is_sparse_layer(n):
            sd[f"{moe}.gate.weight"] = normal((spec.num_experts, H), 2.0 / math.sqrt(H))
            for e in range(spec.num_experts):
                sd.update(mlp(f"{moe}.experts.{e}", spec.expert_intermediate_size, expert_names))
            if spec.arch == "qwen2_moe":
                sd.update(mlp(f"{moe}.shared_expert", spec.shared_expert_intermediate_size, expert_names))
                sd[f"{moe}.shared_expert_gate.weight"] = linear(1, H)
        else:
            sd.update(mlp(f"{p}.mlp", spec.intermediate_size, ("gate_proj", "up_proj", "down_proj")))

        sd[f"{p}.input_layernorm.weight"] = norm(H)
        sd[f"{p}.post_attention_layernorm.weight"] = norm(H)
    sd["model.norm.weight"] = norm(H)
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = linear(V, H)
    dtype = torch_dtype(spec.dtype)
    return {k: v.to(dtype).contiguous() for k, v in sd.items()}


def _write_weights(sd: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None) -> None:
    """One model.safetensors, or save_pretrained-style shards + model.safetensors.index.json."""
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(sd, str(out_dir / "model.safetensors"), metadata=metadata)
        return
    # Greedy in module order, like transformers: start a new shard when the next tensor would overflow.
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, t in sd.items():
        size = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += size
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=metadata)
        weight_map.update({name: fname for name in shard})
    metadata = {
        "total_parameters": sum(t.numel() for t in sd.values()),
        "total_size": sum(t.numel() * t.element_size() for t in sd.values()),
    }
    _write_json(out_dir / "model.safetensors.index.json",
                {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))})


def write_tokenizer(out_dir: str | Path, vocab_size: int, model_max_length: int = 2048) -> None:
    """Byte-level BPE trained on `CORPUS` to at most `vocab_size` tokens (special tokens 0..3 included)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no BOS (like Qwen)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    save_tokenizer(tok, out_dir, model_max_length)


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json, and tokenizer_config.json (ChatML template) and special_tokens_map.json for the
    special tokens at ids 0..3."""
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    tok.save(str(out_dir / "tokenizer.json"))

    def added(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True}

    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {str(i): added(t) for i, t in enumerate(SPECIAL_TOKENS)},
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(out_dir / "special_tokens_map.json", {
        "bos_token": BOS,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END],
    })


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


# Training text for the tokenizer: plain English prose, a little dialogue, numbers and code, so that
# common words become single tokens and a generated sample looks like text. Changing it changes
# every tokenizer this module writes.
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog did not mind; it was a warm afternoon and the
grass was soft. A small bird watched them both from the branch of an old oak tree.
Once upon a time there was a little village at the edge of a great forest. The people of the village
were farmers and weavers, and every morning they walked to the fields while the sun rose over the hills.
In the evening they came home, lit their fires, and told stories about the forest and the river.
The river was wide and slow. Children played on its banks in summer, and in winter it froze so hard
that the whole village could walk across the ice to the market on the other side.
What is the capital of France? The capital of France is Paris. What is the capital of Japan? It is Tokyo.
How many days are there in a week? There are seven days in a week, and twelve months in a year.
Water boils at 100 degrees Celsius and freezes at 0 degrees. The speed of light is about 300,000
kilometres per second. One plus one is two; two times three is six; ten divided by four is 2.5.
A language model predicts the next token from the tokens that came before it. It reads a prompt,
computes a distribution over its vocabulary, picks a token, appends it, and repeats until it sees an
end of text token or reaches the maximum number of new tokens.
A mixture of experts layer sends each token to a few of many small networks. A router scores every
expert for every token, keeps the top two, and adds their outputs weighted by the router's softmax.
Only the chosen experts do any work, so the model can hold many parameters while each token touches few.
User: Hello! Can you help me write a short poem about the sea?
Assistant: Of course. Here is a short poem: The sea is grey, the sea is blue, it sings all night and
all day too. It keeps its secrets deep and cold, and tells them only to the old.
User: Thank you, that is lovely. Can you explain what a neural network is?
Assistant: A neural network is a function built from many simple layers. Each layer multiplies its
input by a matrix of weights, adds a bias, and applies a non-linear function. Training adjusts the
weights so that the outputs match the examples in the data.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

import json
data = {"name": "Alice", "age": 30, "city": "London"}
print(json.dumps(data))
The weather today is sunny with a light breeze from the west. Tomorrow will be cloudy, and on Friday
we expect rain in the morning and clear skies in the afternoon. Temperatures will stay between 12 and
18 degrees for the rest of the week.
She opened the door, looked at the empty street, and smiled. It had been a long year, but the work was
finished, the letters were written, and the train would leave at seven o'clock the next morning.
"Are you ready?" he asked. "I have been ready for weeks," she said, and picked up her bag.
Good morning, good afternoon, good evening, good night. Please and thank you. Yes, no, maybe.
The first step is to read the question carefully. The second step is to write down what you know.
The third step is to find the answer, and the last step is to check that the answer makes sense.
Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 50, 100, 1000, 2024, 3.14159, 42.
Colours: red, orange, yellow, green, blue, indigo, violet, black, white, grey, brown, pink.
Animals: cat, dog, horse, cow, sheep, goat, lion, tiger, bear, wolf, fox, rabbit, mouse, eagle, fish.
Food: bread, butter, cheese, milk, eggs, apples, oranges, rice, soup, tea, coffee, cake, honey.
The history of science is a history of people asking simple questions and refusing easy answers.
Why does the apple fall? Why do the planets move? Why is the sky blue during the day and dark at night?
Every answer opened new questions, and every question was a reason to build a better instrument.
Servers, schedulers and workers pass messages to each other. A request arrives, waits in a queue, is
scheduled into a batch, runs through the layers of the model, and returns its tokens to the client.
"""
