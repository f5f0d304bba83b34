"""tiny_model writes checkpoints that transformers loads as its own, and a working tokenizer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer

from moemesh.entrypoints.tiny_model import (
    ARCHS, BENCH_SPEC, CHAT_TEMPLATE, DEFAULT_SPEC, SPECIAL_TOKENS, TinyModelSpec, hf_config,
    random_state_dict, write_tiny_model, write_tokenizer,
)

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

SPECS = {
    "mixtral": TinyModelSpec("mixtral", num_layers=2),
    "mixtral-tied": TinyModelSpec("mixtral", num_layers=2, tie_word_embeddings=True, seed=1),
    "qwen2_moe-dense-layers": TinyModelSpec(
        "qwen2_moe", num_layers=4, mlp_only_layers=(0,), decoder_sparse_step=2, rope_theta=1e6
    ),
    "qwen3_moe-head_dim": TinyModelSpec("qwen3_moe", num_layers=2, head_dim=32, num_experts=6, top_k=3),
    "llama": TinyModelSpec("llama", num_layers=2),
    "qwen3_moe-sharded-bf16": TinyModelSpec(
        "qwen3_moe", num_layers=2, dtype="bfloat16", max_shard_bytes=64 * 1024, norm_topk_prob=False
    ),
}


def read_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    files = sorted(d.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


@pytest.fixture(scope="module", params=list(SPECS), ids=list(SPECS))
def written(request, tmp_path_factory):
    spec = SPECS[request.param]
    d = write_tiny_model(spec, tmp_path_factory.mktemp(request.param) / "ckpt")
    return spec, d


def test_transformers_loads_checkpoint_without_missing_or_unexpected_keys(written):
    spec, d = written
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert type(model).__name__ == hf_config(spec)["architectures"][0]
    assert model.dtype == getattr(torch, spec.dtype)
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = torch.tensor([[1, 50, 51, 200, 7, 300, 9, 10]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 8, spec.vocab_size)
    assert torch.isfinite(logits).all()
    # Not degenerate: positions disagree on their argmax and logits are spread out.
    assert logits[0].argmax(-1).unique().numel() >= 4
    assert logits.float().std(-1).min() > 0.3


def test_transformers_reads_config_fields(written):
    spec, d = written
    raw = json.loads((d / "config.json").read_text())
    assert raw["rope_theta"] == spec.rope_theta and raw["rope_scaling"] is None
    assert "rope_parameters" not in raw
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.model_type == spec.arch
    assert cfg.rope_parameters["rope_theta"] == spec.rope_theta  # 5.x maps top-level rope_theta
    assert cfg.num_hidden_layers == spec.num_layers
    assert cfg.num_key_value_heads == spec.num_kv_heads
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 0, 0)
    if spec.arch == "mixtral":
        assert raw["num_local_experts"] == spec.num_experts
    if spec.arch in ("qwen2_moe", "qwen3_moe"):
        assert raw["num_experts"] == spec.num_experts  # hub spelling, also for Qwen3-MoE
        assert cfg.norm_topk_prob == spec.resolved_norm_topk_prob
        assert cfg.mlp_only_layers == list(spec.mlp_only_layers)
    if spec.is_moe:
        assert cfg.num_experts == spec.num_experts and cfg.num_experts_per_tok == spec.top_k
    if spec.arch == "qwen3_moe":
        assert cfg.head_dim == spec.resolved_head_dim
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 3] and gen["bos_token_id"] == 1


def test_weight_names_and_shapes_match_transformers_save_pretrained(written, tmp_path):
    spec, d = written
    ours = read_checkpoint(d)
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    reference.save_pretrained(tmp_path / "ref")
    theirs = read_checkpoint(tmp_path / "ref")
    assert set(ours) == set(theirs)
    assert {k: (tuple(v.shape), v.dtype) for k, v in ours.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in theirs.items()
    }


def test_load_then_save_pretrained_is_bit_identical(written, tmp_path):
    spec, d = written
    AutoModelForCausalLM.from_pretrained(d).save_pretrained(tmp_path / "re")
    ours, resaved = read_checkpoint(d), read_checkpoint(tmp_path / "re")
    assert set(ours) == set(resaved)
    for k in ours:
        assert torch.equal(ours[k], resaved[k]), k


def reference_moe(spec: TinyModelSpec, sd: dict[str, torch.Tensor], layer: int, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H], from the hub-named per-expert tensors, with the semantics the names claim."""
    if spec.arch == "mixtral":
        p, (gate, up, down) = f"model.layers.{layer}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        p, (gate, up, down) = f"model.layers.{layer}.mlp", ("gate_proj", "up_proj", "down_proj")

    def mlp(q, x):
        return (F.silu(x @ sd[f"{q}.{gate}.weight"].T) * (x @ sd[f"{q}.{up}.weight"].T)) @ sd[f"{q}.{down}.weight"].T

    probs = (x @ sd[f"{p}.gate.weight"].T).softmax(-1)  # [T, E]
    weights, experts = probs.topk(spec.top_k, dim=-1)  # [T, K]
    if spec.resolved_norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            out[t] += w * mlp(f"{p}.experts.{int(e)}", x[t])
    if spec.arch == "qwen2_moe":
        out += torch.sigmoid(x @ sd[f"{p}.shared_expert_gate.weight"].T) * mlp(f"{p}.shared_expert", x)
    return out


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe-dense-layers", "qwen3_moe-head_dim"])
def test_expert_names_mean_what_they_say(name, tmp_path):
    """w1 is gate, w3 is up, w2 is down (etc.): HF's sparse block matches a per-expert reference."""
    spec = SPECS[name]
    d = write_tiny_model(spec, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(d)
    sd = read_checkpoint(d)
    layer = next(n for n in range(spec.num_layers) if spec.is_sparse_layer(n))
    x = torch.randn(6, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.model.layers[layer].mlp(x[None])[0]
    torch.testing.assert_close(got, reference_moe(spec, sd, layer, x), rtol=1e-4, atol=1e-4)


def test_sparse_layer_rule_for_qwen():
    spec = SPECS["qwen2_moe-dense-layers"]
    assert [spec.is_sparse_layer(n) for n in range(4)] == [False, True, False, True]
    sd = random_state_dict(spec)
    assert "model.layers.0.mlp.gate_proj.weight" in sd and "model.layers.0.mlp.gate.weight" not in sd
    assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (spec.intermediate_size, spec.hidden_size)
    assert sd["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (spec.moe_intermediate_size, spec.hidden_size)
    assert sd["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, spec.hidden_size)


def test_sharded_index_like_save_pretrained(tmp_path):
    spec = SPECS["qwen3_moe-sharded-bf16"]
    d = write_tiny_model(spec, tmp_path)
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert {p.name for p in shards} == set(index["weight_map"].values())
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    sd = random_state_dict(spec)
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    for p in shards:
        with safe_open(str(p), "pt") as sf:
            keys = list(sf.keys())
            sizes = [sf.get_tensor(k).numel() * 2 for k in keys]
        assert sum(sizes) <= spec.max_shard_bytes or len(keys) == 1
        assert all(index["weight_map"][k] == p.name for k in keys)


def test_deterministic_and_seeded(tmp_path):
    spec = TinyModelSpec("qwen2_moe", num_layers=2)
    a, b = write_tiny_model(spec, tmp_path / "a"), write_tiny_model(spec, tmp_path / "b")
    for f in sorted(a.iterdir()):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    other = random_state_dict(TinyModelSpec("qwen2_moe", num_layers=2, seed=1))
    assert not torch.equal(random_state_dict(spec)["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_tokenizer_is_identical_across_processes(tmp_path):
    write_tokenizer(tmp_path / "here", 512)
    code = "import sys; from moemesh.entrypoints.tiny_model import write_tokenizer; write_tokenizer(sys.argv[1], 512)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True,
                   env={"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "PATH": ""})
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "here" / name).read_bytes() == (tmp_path / "there" / name).read_bytes()


TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces  \n\n\ttabs and newlines\r\n",
    "naïve café, Straße, façade, São Paulo, Ångström",
    "emoji 😀🚀👩‍👩‍👧 and CJK 中文字符 日本語 한국어",
    "code: def f(x):\n    return x ** 2  # ok",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.mark.parametrize("vocab_size", [300, 512, 32000])
def test_tokenizer_round_trips_and_fits_vocab(vocab_size, tmp_path):
    write_tokenizer(tmp_path, vocab_size)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() <= vocab_size
    assert tok.get_vocab_size() >= 260  # specials + the byte alphabet
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert max(ids, default=0) < vocab_size
    assert 1 not in tok.encode("hi there").ids  # no BOS added
    if vocab_size >= 512:  # merges learned from the corpus
        assert len(tok.encode("The capital of France is Paris.").ids) <= 12


def test_autotokenizer_loads_and_applies_chat_template(tmp_path):
    write_tokenizer(tmp_path, 512, model_max_length=777)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|endoftext|>", "<|endoftext|>", "<s>")
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (0, 0, 1)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [2, 3]
    assert tok.model_max_length == 777
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert 1 not in ids or "<s>" in text
        assert tok.decode(ids) == text
    assert tok.decode(tok("a <|im_end|> b")["input_ids"], skip_special_tokens=True) == "a  b"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, tokenize=False) == prompt.removesuffix("<|im_start|>assistant\n")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids.count(2) == 3 and ids.count(3) == 2
    assert tok.decode(ids) == prompt
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_spec_validation():
    with pytest.raises(ValueError):
        TinyModelSpec("gpt2")
    with pytest.raises(ValueError):
        TinyModelSpec("mixtral", vocab_size=299)
    with pytest.raises(ValueError):
        write_tokenizer("/nonexistent-never-created", 299)
    with pytest.raises(ValueError):
        TinyModelSpec("mixtral", dtype="int8")
    with pytest.raises(ValueError):
        TinyModelSpec("mixtral", norm_topk_prob=False)
    with pytest.raises(ValueError):
        TinyModelSpec("llama", mlp_only_layers=(0,))
    with pytest.raises(ValueError):
        TinyModelSpec("mixtral", num_heads=4, num_kv_heads=3)
    assert TinyModelSpec("qwen3_moe").resolved_norm_topk_prob is True
    assert TinyModelSpec("qwen2_moe").resolved_norm_topk_prob is False


def test_builtin_specs_are_valid_mixtrals():
    assert BENCH_SPEC.arch == DEFAULT_SPEC.arch == "mixtral"
    assert (BENCH_SPEC.hidden_size, BENCH_SPEC.num_layers, BENCH_SPEC.vocab_size) == (512, 8, 32000)
    assert set(ARCHS) == {"mixtral", "qwen2_moe", "qwen3_moe", "llama"}
    cfg = hf_config(DEFAULT_SPEC)
    assert cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 2


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "llama"])
def test_the_parameter_count_is_the_written_weights(arch):
    """num_parameters (what make-tiny-model checks against the host's memory before it draws anything)
    counts what random_state_dict draws, layer kinds and tied embeddings included."""
    extra = {"mlp_only_layers": (1,), "decoder_sparse_step": 1} if arch.startswith("qwen") else {}
    for tied in (False, True):
        spec = TinyModelSpec(arch=arch, num_layers=3, tie_word_embeddings=tied, head_dim=8, **extra)
        assert spec.num_parameters() == sum(t.numel() for t in random_state_dict(spec).values())
