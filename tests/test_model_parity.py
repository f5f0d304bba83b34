"""Each architecture against the Hugging Face transformers implementation, on tiny checkpoints
written both by transformers' save_pretrained and by our make-tiny-model."""

from __future__ import annotations

import pytest
import torch

from hf_models import build_hf_model, hf_greedy, hf_logits
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.sampling import SamplingParams
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "llama"]
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 250, 251, 3, 4, 77, 78, 79, 80],
           list(range(30, 70)), [299, 1, 298, 2]]
NEW_TOKENS = 32

TINY_SPECS = {
    "mixtral": TinyModelSpec(arch="mixtral", num_layers=3, hidden_size=64, intermediate_size=96, num_experts=4,
                             vocab_size=384, tie_word_embeddings=True),
    "qwen2_moe": TinyModelSpec(arch="qwen2_moe", num_layers=4, hidden_size=64, moe_intermediate_size=48,
                               shared_expert_intermediate_size=80, num_experts=6, decoder_sparse_step=2,
                               vocab_size=384),
    "qwen3_moe": TinyModelSpec(arch="qwen3_moe", num_layers=3, hidden_size=64, head_dim=24, num_experts=8,
                               top_k=4, mlp_only_layers=(1,), vocab_size=384),
    "llama": TinyModelSpec(arch="llama", num_layers=3, hidden_size=64, intermediate_size=160, vocab_size=384),
}


class Reference:
    """A checkpoint directory and the transformers model that reads it, with greedy outputs cached."""

    def __init__(self, path, hf_model):
        self.path, self.hf = path, hf_model
        self._greedy = {}

    def greedy(self, prompt):
        key = tuple(prompt)
        if key not in self._greedy:
            self._greedy[key] = hf_greedy(self.hf, prompt, NEW_TOKENS)
        return self._greedy[key]


@pytest.fixture(scope="module", params=[(a, s) for a in ARCHS for s in ("hf", "tiny")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def reference(request, tmp_path_factory):
    arch, source = request.param
    path = tmp_path_factory.mktemp(f"{arch}-{source}")
    if source == "hf":
        hf = build_hf_model(arch, path)
    else:
        from transformers import AutoModelForCausalLM

        write_tiny_model(TINY_SPECS[arch], path)
        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return Reference(path, hf)


def all_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through every stage of an idle engine."""
    return engine.prompt_logits(prompt)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_prefill_logits_match(reference):
    engine = LLMEngine(EngineSettings(model=str(reference.path), num_kv_blocks=64), progress=False)
    for prompt in PROMPTS:
        assert rel_err(all_logits(engine, prompt), hf_logits(reference.hf, prompt)) < 1e-4


@pytest.mark.parametrize("layout", ["default", "chunked", "small-blocks", "multi-step", "speculative", "full-head",
                                    "screened-head", "screened-head-onednn", "screened-multi-step",
                                    "screened-multi-step-onednn"])
def test_greedy_matches_transformers(reference, layout, monkeypatch):
    cfg = {
        "default": dict(block_size=16, num_kv_blocks=64),
        "chunked": dict(block_size=16, num_kv_blocks=64, max_batched_tokens=7),  # prompts in chunks
        "small-blocks": dict(block_size=2, num_kv_blocks=400),
        "multi-step": dict(block_size=4, num_kv_blocks=200, num_scheduler_steps=5),  # decodes in bursts of 5
        # decodes with up to 3 draft tokens from prompt lookup (any earlier occurrence of the last token)
        "speculative": dict(block_size=4, num_kv_blocks=200, num_speculative_tokens=3, ngram_prompt_lookup_min=1,
                            speculative_disable_by_batch_size=8),
        # greedy tokens from every float32 logit, or through the lm_head's screen (kernels/cpu_gemm.py
        # ScreenedHead: its copy multiplied by these kernels or by torch's matmul), whichever this CPU
        # would pick
        "full-head": dict(block_size=16, num_kv_blocks=64),
        "screened-head": dict(block_size=16, num_kv_blocks=64),
        "screened-head-onednn": dict(block_size=16, num_kv_blocks=64),
        "screened-multi-step": dict(block_size=4, num_kv_blocks=200, num_scheduler_steps=5),
        # (torch's product stays out of the native bursts: they take the full head)
        "screened-multi-step-onednn": dict(block_size=4, num_kv_blocks=200, num_scheduler_steps=5),
    }[layout]
    screened = layout.startswith("screened")
    if layout == "full-head" or screened:
        from moemesh_kernels import cpu_gemm

        if cpu_gemm.native() is None:
            pytest.skip("no C compiler: the native kernels cannot be built here")
        choice = [(("onednn" if layout.endswith("onednn") else "native"), 1)] if screened else []
        monkeypatch.setattr(cpu_gemm, "screen_product", lambda head, vocab, lib: choice)
        calls, tokens = [], cpu_gemm.ScreenedHead.tokens
        monkeypatch.setattr(cpu_gemm.ScreenedHead, "tokens", lambda self, x: calls.append(len(x)) or tokens(self, x))
    engine = LLMEngine(EngineSettings(model=str(reference.path), **cfg), progress=False)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference.greedy(prompt), f"prompt of {len(prompt)} tokens"
    if layout == "speculative":
        assert engine.scheduler.num_drafted > 0
    if layout == "full-head" or screened:
        assert engine.stages[-1].runner.model.can_screen == screened
        assert bool(calls) == screened  # (the bursts of several steps screen inside mm_greedy_decode)
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_greedy_matches_transformers_with_tied_routers(tmp_path, arch):
    """Routers whose scores tie exactly (the first layer's all zero, as a zero-initialised router;
    the others with two pairs of equal rows, as an upcycled one): the experts among the tied ones are
    the ones torch.topk picks, so greedy tokens stay transformers', step by step and in bursts
    (kernels/README.md)."""
    from moemesh_kernels import cpu_gemm

    hf = build_hf_model(arch)
    tied = 0
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            router = getattr(layer.mlp, "gate", None)
            if getattr(router, "weight", None) is None or router.weight.shape[0] < 4:
                continue  # (a dense layer)
            if i == 0:
                router.weight.zero_()
            else:
                router.weight[1] = router.weight[0]
                router.weight[3] = router.weight[2]
            tied += 1
    assert tied >= 2
    hf.save_pretrained(tmp_path)
    lib = cpu_gemm.native()
    if lib is not None and not lib.torch_tie_order:
        pytest.skip("no C++ compiler: the native kernels break ties toward the lower expert")
    for cfg in (dict(block_size=16, num_kv_blocks=64), dict(block_size=4, num_kv_blocks=200, num_scheduler_steps=5)):
        engine = LLMEngine(EngineSettings(model=str(tmp_path), **cfg), progress=False)
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_greedy(hf, prompt, 16), (cfg, prompt)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stages", [(2, 2), (1, 3), (1, 1, 2)], ids=lambda s: "+".join(map(str, s)))
def test_stage_split_matches_unsplit(tmp_path, arch, stages):
    build_hf_model(arch, tmp_path)
    whole = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=64), progress=False)
    split = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=64, layer_partition=stages), progress=False)
    assert [s.runner.model.layer_range for s in split.stages] == [range(a, a + n) for a, n in
                                                          zip([0, *torch.tensor(stages).cumsum(0).tolist()], stages)]
    assert split.stages[0].runner.model.has_embedding and not split.stages[0].runner.model.has_head
    assert split.stages[-1].runner.model.has_head and not split.stages[-1].runner.model.has_embedding
    for prompt in PROMPTS[:3]:
        torch.testing.assert_close(all_logits(split, prompt), all_logits(whole, prompt), rtol=0, atol=1e-5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in split.generate(PROMPTS, params)] == \
        [o.token_ids for o in whole.generate(PROMPTS, params)]


def test_long_context_config_builds_rotary_tables_for_the_kv_cache_only(tmp_path):
    """A config.json whose max_position_embeddings is far beyond any cache (10^12: a table of it would be
    terabytes) loads: each stage's rotary tables stop at the positions its KV cache can hold, and greedy
    tokens are still transformers'."""
    hf = build_hf_model("mixtral", tmp_path, max_position_embeddings=10**12)
    engine = LLMEngine(EngineSettings(model=str(tmp_path), num_kv_blocks=64, block_size=16), progress=False)
    runner = engine.stages[0].runner
    assert runner.max_positions == 64 * 16
    from stage_worker.layers.rotary import RotaryEmbedding
    tables = [m.cos.shape[0] for m in runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables and set(tables) == {64 * 16}
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS[:2], outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)
