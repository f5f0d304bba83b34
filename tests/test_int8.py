"""Weight-only int8 (`--quantization int8`): whole models stay close to float32, and the native
kernels compute the same numbers as torch on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from moemesh.config import ConfigError, ModelConfig
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.sampling import SamplingParams
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
from stage_worker.layers.fp8 import resolve_quantization
from moemesh_kernels.cpu_gemm import native
from stage_worker.layers.int8 import Int8Config

# Random tiny models amplify weight error through every layer (see test_fp8_model); int8's error per
# weight is 16x smaller than e4m3's, and so is the bound.
MAX_REL_LOGIT_ERROR = 0.05
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7, 300, 12], list(range(30, 52))]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "llama"])
def checkpoint(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"int8-{request.param}")
    write_tiny_model(TinyModelSpec(arch=request.param, num_layers=2, hidden_size=64, intermediate_size=96,
                                   moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=4,
                                   vocab_size=384, tie_word_embeddings=request.param == "mixtral"), d)
    return d


def engine(path, **kw):
    return LLMEngine(EngineSettings(model=str(path), num_kv_blocks=64, **kw), progress=False)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.skipif(native() is None, reason="no C compiler: the native kernels cannot be built here")
def test_int8_stays_close_to_float32_and_native_equals_torch(checkpoint):
    base = engine(checkpoint)
    native = engine(checkpoint, quantization="int8", moe_backend="native")
    torch_path = engine(checkpoint, quantization="int8", moe_backend="torch")
    model = native.stages[0].runner.model
    layer = model.model.layers["0"]
    assert model.lm_head.packed.data.dtype == torch.int8
    assert layer.self_attn.qkv_proj.packed.data.dtype == layer.self_attn.o_proj.packed.data.dtype == torch.int8
    mlp = layer.mlp.experts.packed if hasattr(layer.mlp, "experts") else (layer.mlp.gate_up_proj.packed,)
    assert all(p.data.dtype == torch.int8 for p in mlp)
    if hasattr(layer.mlp, "gate"):  # the router stays in the model dtype
        assert layer.mlp.gate.packed.data.dtype == torch.float32
    for prompt in PROMPTS:
        want = base.prompt_logits(prompt)
        got = native.prompt_logits(prompt)
        assert 0 < rel(got, want) < MAX_REL_LOGIT_ERROR  # quantized (not 0), and close
        # the same int8 weights multiplied by torch (dequantized) or by the kernels: float noise apart
        assert rel(got, torch_path.prompt_logits(prompt)) < 1e-4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in native.generate(PROMPTS, params)] == \
        [o.token_ids for o in torch_path.generate(PROMPTS, params)]


def test_int8_is_refused_on_an_fp8_checkpoint(checkpoint):
    mc = ModelConfig.from_dir(checkpoint)
    assert isinstance(resolve_quantization(mc, "int8"), Int8Config)
    fp8 = ModelConfig(**{**mc.__dict__, "quantization": "fp8"})
    with pytest.raises(ConfigError, match="--quantization int8 needs a 16/32-bit checkpoint"):
        resolve_quantization(fp8, "int8")
