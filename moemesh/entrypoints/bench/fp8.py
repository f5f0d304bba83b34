"""`moemesh bench fp8`: how far FP8 (or int8, `--quantization fp8,int8`) moves a model, in the way vLLM's MoE refactor compared bf16 and
fp8: logits of the same prompts (max |difference| / max |logit|) and how often greedy decoding
picks the same tokens (the first token, every position, and the common prefix before the first
difference), against the unquantized model in the same run."""

from __future__ import annotations

import json

import torch

from moemesh.config import ModelConfig
from moemesh.errors import CLIError, ConfigError
from moemesh.entrypoints.bench.throughput import check_lengths
from moemesh.entrypoints.engine import LLMEngine
from moemesh.settings import EngineSettings
from moemesh.sampling import SamplingParams


def run_fp8_bench(args) -> int:
    bad = [q for q in args.quantization if q not in ("fp8", "int8")]
    if bad or not args.quantization:
        raise CLIError(f"--quantization {','.join(bad)}: each must be fp8 or int8")
    mc = ModelConfig.from_dir(args.model)
    if mc.quantization is not None:  # (it would be compared with itself)
        raise CLIError(f"--model {args.model} is already quantized ({mc.quantization}): give its 16/32-bit checkpoint")
    if args.fp8_model:
        try:
            fp8 = ModelConfig.from_dir(args.fp8_model)
        except ConfigError as e:
            raise CLIError(str(e).replace("--model", "--fp8-model", 1)) from None
        if fp8.quantization != "fp8":
            raise CLIError(f"--fp8-model {args.fp8_model} is not an FP8 checkpoint (`moemesh quantize` writes one)")
        same = ("model_type", "vocab_size", "hidden_size", "num_layers", "num_experts")
        if any(getattr(fp8, k) != getattr(mc, k) for k in same):
            raise CLIError(f"--fp8-model {args.fp8_model} is not --model {args.model} quantized: their configs differ "
                           f"in {', '.join(k for k in same if getattr(fp8, k) != getattr(mc, k))}")
    check_lengths(mc, args.prompt_len, args.new)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    base = LLMEngine(EngineSettings(model=args.model, num_kv_blocks=1024), progress=None)
    vocab = base.model_config.vocab_size
    prompts = [torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in base.generate(prompts, params)]
    variants = {f"{q} in place": EngineSettings(model=args.model, num_kv_blocks=1024, quantization=q)
                for q in args.quantization}
    if args.fp8_model:
        variants["fp8 checkpoint"] = EngineSettings(model=args.fp8_model, num_kv_blocks=1024)
    for name, cfg in variants.items():
        engine = LLMEngine(cfg, progress=None)
        err = max(_rel_error(engine.prompt_logits(p), base.prompt_logits(p)) for p in prompts[:4])
        got = [o.token_ids for o in engine.generate(prompts, params)]
        same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(got, want)]
        row = {"variant": name, "max_rel_logit_error": round(err, 4),
               "first_token_agreement": round(sum(x[0] == y[0] for x, y in zip(got, want)) / len(want), 3),
               "position_agreement": round(same / sum(len(y) for y in want), 3),
               "mean_common_prefix": round(sum(prefix) / len(prefix), 2), "new_tokens": args.new}
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()
