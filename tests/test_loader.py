"""Loading by stage and by tensor rank, sharded checkpoints, and the errors a user can hit."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import build_hf_model
from moemesh.config import ConfigError, ModelConfig
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.sampling import SamplingParams
from stage_worker.layers.parallel import TPGroup
from stage_worker.loader import LoadError, load_model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6], [100, 7]]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    build_hf_model("qwen2_moe", path, max_shard_size="150KB")
    return path


def test_sharded_checkpoint_loads_and_matches_single_file(sharded, tmp_path):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    build_hf_model("qwen2_moe", tmp_path)  # same seed, one file
    assert not (tmp_path / "model.safetensors.index.json").exists()
    a = LLMEngine(EngineSettings(model=str(sharded), num_kv_blocks=16), progress=False).generate(PROMPTS, GREEDY)
    b = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=16), progress=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_stage_reads_only_its_own_tensors(sharded):
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    _, stats = load_model(sharded, layers=range(2, 4), progress=False)
    mine = {n for n in weight_map if n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head."))}
    assert stats.tensors_read == mine
    assert stats.files_opened == {weight_map[n] for n in mine}
    assert stats.files_opened != set(weight_map.values())

    _, first = load_model(sharded, layers=range(0, 1), progress=False)
    assert "model.embed_tokens.weight" in first.tensors_read and "lm_head.weight" not in first.tensors_read
    assert all(not n.startswith("model.layers.") or n.startswith("model.layers.0.") for n in first.tensors_read)


def test_tensor_rank_reads_its_slice(sharded):
    config = ModelConfig.from_dir(sharded)
    # torch's backend keeps the loaded [E, rows, cols] parameters (native packs them)
    full, full_stats = load_model(sharded, layers=range(0, 1), progress=False, backend="torch")
    experts = full.model.layers["0"].mlp.experts
    I = config.moe_intermediate_size
    gate, up, down = experts.w13_weight[:, :I], experts.w13_weight[:, I:], experts.w2_weight
    expert_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    for rank in range(2):
        part, stats = load_model(sharded, config, layers=range(0, 1), tp=TPGroup(rank, 2), progress=False,
                                 backend="torch")
        mine = part.model.layers["0"].mlp.experts
        cols = slice(rank * I // 2, (rank + 1) * I // 2)
        assert torch.equal(mine.w13_weight, torch.cat([gate[:, cols], up[:, cols]], dim=1))
        assert torch.equal(mine.w2_weight, down[:, :, cols])
        assert sum(p.numel() * p.element_size() for p in mine.parameters()) * 2 == expert_bytes
        assert stats.bytes_read < 0.75 * full_stats.bytes_read  # only slices were read


def _copy_without(src, dst, drop=None, reshape=None):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].clone()
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    build_hf_model("mixtral", path)
    return path


def test_missing_tensor_is_named(single, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    _copy_without(single, tmp_path / "m", drop=name)
    with pytest.raises(LoadError, match=f"{name}.*missing"):
        load_model(tmp_path / "m", progress=False)


def test_misshapen_tensor_names_tensor_and_file(single, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    _copy_without(single, tmp_path / "m", reshape=name)
    with pytest.raises(LoadError, match=rf"{name}.*model\.safetensors.*shape \(31, 64\).*expected \(32, 64\)"):
        load_model(tmp_path / "m", progress=False)


def test_unsupported_architecture_lists_the_supported(single, tmp_path):
    shutil.copytree(single, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM.*MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        load_model(tmp_path / "m", progress=False)


def test_config_spellings():
    base = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, intermediate_size=8, num_experts_per_tok=1)
    hub = ModelConfig.from_hf({**base, "num_experts": 4, "rope_theta": 5e5,
                               "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    new = ModelConfig.from_hf({**base, "num_local_experts": 4,
                               "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert hub == new and hub.num_experts == 4 and hub.rope.theta == 5e5 and hub.rope.rope_type == "llama3"
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        ModelConfig.from_hf({**base, "num_experts": 4, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="'num_attention_heads'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "num_attention_heads"})
    for top_k in (5, 0, None):  # (a crash mid-request on every kernel path otherwise)
        with pytest.raises(ConfigError, match="num_experts_per_tok"):
            ModelConfig.from_hf({**base, "num_experts": 4, "num_experts_per_tok": top_k})


def test_fields_a_config_leaves_out_take_transformers_defaults_and_bad_ones_are_named():
    """What transformers' config classes fill in for a missing field (Mixtral's rope_theta 1e6 and eps
    1e-5, Qwen2-MoE's 5632-wide shared expert), Qwen2-MoE's qkv_bias switch, no attention biases for
    Mixtral (transformers has none), and rope scalings or head counts that cannot work refused."""
    base = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=8, num_experts_per_tok=1)
    mixtral = ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 4, "attention_bias": True})
    assert (mixtral.rope.theta, mixtral.rms_norm_eps, mixtral.max_position_embeddings) == (1e6, 1e-5, 131072)
    assert not mixtral.qkv_bias and not mixtral.o_bias
    qwen2 = ModelConfig.from_hf({**base, "model_type": "qwen2_moe", "num_experts": 4})
    assert qwen2.shared_expert_intermediate_size == 5632 and qwen2.qkv_bias and qwen2.rope.theta == 1e4
    assert not ModelConfig.from_hf({**base, "model_type": "qwen2_moe", "num_experts": 4, "qkv_bias": False}).qkv_bias
    assert ModelConfig.from_hf({**base, "model_type": "llama"}).max_position_embeddings == 2048
    # integral floats where transformers takes them (a context length, llama3's original one)
    floats = ModelConfig.from_hf({**base, "model_type": "llama", "max_position_embeddings": 4096.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192.0}})
    assert (floats.max_position_embeddings, floats.rope.original_max_position_embeddings) == (4096, 8192)
    for bad in ({"max_position_embeddings": 4096.5}, {"hidden_size": 8.0}, {"rope_scaling": {"factor": "8.0"}}):
        with pytest.raises(ConfigError, match=next(iter(bad)) if "rope" not in next(iter(bad)) else "factor"):
            ModelConfig.from_hf({**base, "model_type": "llama", **bad})
    with pytest.raises(ConfigError, match="sliding_window=4096"):  # (against the default 131072 positions)
        ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 4, "sliding_window": 4096})
    for bad, match in [({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor"),
                       ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                          "high_freq_factor": 4.0}}, "low_freq_factor < high_freq_factor"),
                       ({"num_attention_heads": 4, "num_key_value_heads": 3, "head_dim": 2}, "multiple of"),
                       ({"head_dim": 9}, "head_dim 9 is odd"), ({"hidden_size": 10}, "head_dim 5 is odd")]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_hf({**base, "model_type": "llama", **bad})


def test_config_fields_are_read_as_transformers_reads_them(tmp_path):
    """The fields whose reading differed from transformers' (the oracle: its AutoConfig on the same
    config.json): a rope_scaling added beside rope_parameters replaces it; Mixtral slides wherever
    sliding_window is set, the Qwen MoE models 4096 wide when use_sliding_window alone is set; each
    architecture's own defaults for the head, expert and width counts, and fields only the
    architectures that have them read."""
    import transformers

    def theirs(config: dict):  # (as transformers loads a checkpoint's config.json)
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return transformers.AutoConfig.from_pretrained(d)

    base = dict(vocab_size=10, hidden_size=16, num_hidden_layers=2, num_attention_heads=8, intermediate_size=8)
    qwen3 = {**base, "model_type": "qwen3_moe", "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    linear = {**qwen3, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    hf = theirs(linear).rope_parameters
    ours = ModelConfig.from_hf(linear).rope
    assert (ours.rope_type, ours.factor, ours.theta) == (hf["rope_type"], hf["factor"], hf["rope_theta"]) \
        == ("linear", 4.0, 1e4)
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        ModelConfig.from_hf({**qwen3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    mixtral = {**base, "model_type": "mixtral"}
    with pytest.raises(ConfigError, match="sliding_window=8"):
        ModelConfig.from_hf({**mixtral, "sliding_window": 8, "use_sliding_window": False})
    with pytest.raises(ConfigError, match="sliding_window=4096.*use_sliding_window"):
        ModelConfig.from_hf({**qwen3, "use_sliding_window": True})
    assert ModelConfig.from_hf({**qwen3, "use_sliding_window": True, "sliding_window": None})
    # left out: transformers' defaults (Mixtral: 8 KV heads, 8 experts, top 2; Qwen3-MoE: 768 wide experts)
    hf = theirs(mixtral)
    ours = ModelConfig.from_hf({**mixtral, "decoder_sparse_step": 2, "mlp_only_layers": [0]})
    assert (ours.num_kv_heads, ours.num_experts, ours.top_k) == (hf.num_key_value_heads, hf.num_local_experts,
                                                                 hf.num_experts_per_tok) == (8, 8, 2)
    assert (ours.decoder_sparse_step, ours.mlp_only_layers) == (1, ())  # (Mixtral's layers are all sparse)
    ours = ModelConfig.from_hf({**qwen3, "shared_expert_intermediate_size": 32})  # (and no moe_intermediate_size)
    assert (ours.moe_intermediate_size, ours.shared_expert_intermediate_size) == (768, 0)  # (no shared expert)
    sixteen = {**mixtral, "hidden_size": 32, "num_attention_heads": 16}  # (not Mixtral's default 8 KV heads)
    assert ModelConfig.from_hf({**sixteen, "num_key_value_heads": None}).num_kv_heads == 16  # (null: one per head)
    assert ModelConfig.from_hf(sixteen).num_kv_heads == 8
    with pytest.raises(ConfigError, match="no model_type.*'mixtral'"):
        ModelConfig.from_hf({**base, "architectures": ["MixtralForCausalLM"]})


def test_a_stray_weights_file_beside_model_safetensors_is_not_read(single, tmp_path):
    """Without an index transformers reads model.safetensors alone; without either, a tensor in two
    files is refused (the last file in name order had won, silently)."""
    shutil.copytree(single, tmp_path / "m")
    name = "model.layers.0.self_attn.q_proj.weight"
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    save_file({name: torch.zeros_like(weights[name])}, str(tmp_path / "m" / "model_old.safetensors"))
    _, stats = load_model(tmp_path / "m", progress=False)
    assert stats.files_opened == {"model.safetensors"} and name in stats.bytes_by_tensor
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "model-a.safetensors")
    with pytest.raises(LoadError, match=f"{name}.*both model-a.safetensors and model_old.safetensors"):
        load_model(tmp_path / "m", progress=False)


def test_fp8_codes_where_moemesh_loads_floats_and_a_broken_index_are_refused(single, tmp_path):
    """An FP8 checkpoint that quantized a router gate without listing it in ignored_layers would load
    its codes as plain numbers (logits hundreds of times too large): refused, naming the tensor; an
    index that is not one is named too."""
    shutil.copytree(single, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    gate = "model.layers.0.block_sparse_moe.gate.weight"
    tensors[gate] = tensors[gate].to(torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(LoadError, match=f"{gate}.*F8_E4M3.*unquantized"):
        load_model(tmp_path / "m", progress=False)
    shutil.copytree(single, tmp_path / "i")
    (tmp_path / "i" / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(LoadError, match="weight_map"):
        load_model(tmp_path / "i", progress=False)


def test_every_layer_shares_one_rotary_table(single):
    """One cos/sin pair per model, not per layer (at 131072 positions of 128 dims each pair is 128 MiB)."""
    from stage_worker.layers.rotary import RotaryEmbedding

    model, _ = load_model(single, progress=False)
    rotary = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(rotary) == ModelConfig.from_dir(single).num_layers > 1
    assert len({(m.cos.data_ptr(), m.sin.data_ptr()) for m in rotary}) == 1


def test_generate_that_refuses_a_prompt_leaves_the_engine_as_it_was(single):
    """A refused prompt (or a step that fails) aborts what that call added: the next call computes only
    its own; params that do not pair with the prompts are refused."""
    engine = LLMEngine(EngineSettings(model=str(single), num_kv_blocks=64), progress=False)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5, 6, 7], []], GREEDY)
    assert not engine.core.has_work() and engine.core.blocks.num_free == engine.core.blocks.num_blocks
    with pytest.raises(ValueError, match="2 prompts and 1 sampling params"):
        engine.generate([[5, 6], [7, 8, 9]], [GREEDY])
    assert [len(o.token_ids) for o in engine.generate([[5, 6, 7]], GREEDY)] == [6]
