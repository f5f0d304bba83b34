"""`moemesh bench fp8`: how far FP8 moves a model, in the way vLLM's MoE refactor compared bf16 and
fp8: logits of the same prompts (max |difference| / max |logit|) and how often greedy decoding
picks the same tokens (the first token, every position, and the common prefix before the first
difference), against the unquantized model in the same run."""

from __future__ import annotations

import json

import torch

from moemesh.engine import EngineConfig, LLMEngine
from moemesh.sampling import SamplingParams
from stage_worker.context import build_context, forward_context
from stage_worker.runner import StepInput


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position of an idle engine (its blocks 0.. as scratch)."""
    blocks = list(range(-(-len(prompt) // engine.cfg.block_size)))
    step = StepInput([prompt], [0], [blocks], [True])
    hidden = residual = None
    for stage in engine.stages:
        ctx = build_context(step.query_lens, step.context_lens, step.block_tables, engine.cfg.block_size)
        with torch.inference_mode(), forward_context(ctx):
            if stage.runner.model.has_embedding:
                hidden = stage.runner.model.embed(torch.tensor(prompt))
            hidden, residual = stage.runner.model(hidden, residual)
    return engine.stages[-1].runner.model.compute_logits(hidden, residual)


def run_fp8_bench(args) -> int:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    base = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=1024), progress=None)
    vocab = base.model_config.vocab_size
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in base.generate(prompts, params)]
    variants = {"fp8 in place": EngineConfig(model=args.model, num_kv_blocks=1024, quantization="fp8")}
    if args.fp8_model:
        variants["fp8 checkpoint"] = EngineConfig(model=args.fp8_model, num_kv_blocks=1024)
    for name, cfg in variants.items():
        engine = LLMEngine(cfg, progress=None)
        err = max(((prompt_logits(engine, p) - prompt_logits(base, p)).abs().max()
                   / prompt_logits(base, p).abs().max()).item() for p in prompts[:4])
        got = [o.token_ids for o in engine.generate(prompts, params)]
        same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(got, want)]
        row = {"variant": name, "max_rel_logit_error": round(err, 4),
               "first_token_agreement": round(sum(x[0] == y[0] for x, y in zip(got, want)) / len(want), 3),
               "position_agreement": round(same / sum(len(y) for y in want), 3),
               "mean_common_prefix": round(sum(prefix) / len(prefix), 2), "new_tokens": args.new}
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0
