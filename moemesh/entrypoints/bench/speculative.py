"""`moemesh bench speculative`: what prompt-lookup drafts (--num-speculative-tokens) buy on a text
workload, against the same engine without them, in one process.

The prompts are windows of --prompt-len tokens of the texts in --prompts (JSON lines with a "text"
or a "prompt"; the first window of each text, then the second of each, and so on; by default
eval/demo/heldout.jsonl, Python source the demo model did not train on), tokenized by the model's
tokenizer. For each batch size the in-process engine without drafts, then with each
--num-speculative-tokens value (drafting at every batch size measured), prefills the batch's prompts
in one step and decodes --new tokens for each; each figure is the best of --repeats runs.

Greedy (--temperature 0), in float32 every run's tokens must equal the baseline's (the command fails
where they do not); in bfloat16 or int8 a step's rows can tip a near-tie (kernels/README.md), and
each row says how many sequences kept the baseline's tokens. With --temperature above 0 the requests
sample (no seed; the engines with drafts run --speculative-sampling, checking them by speculative
sampling), and tokens are not compared. Printed per (batch, k): decode tokens/s, its ratio to the
baseline's, the share of draft tokens kept, and tokens per decode step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from moemesh.config import ModelConfig, resolve_dtype
from moemesh.entrypoints.bench.throughput import check_lengths
from moemesh.entrypoints.engine import LLMEngine
from moemesh.errors import CLIError
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings

DEFAULT_PROMPTS = Path(__file__).resolve().parents[3] / "eval" / "demo" / "heldout.jsonl"


def load_prompts(path: str | None, model: str, n: int, prompt_len: int) -> list[list[int]]:
    from moemesh.tokenizer import TextTokenizer

    file = Path(path) if path else DEFAULT_PROMPTS
    if not file.is_file():
        raise CLIError(f"--prompts {file}: no such file (JSON lines, each with a \"text\" or a \"prompt\")")
    texts = []
    with open(file, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    texts.append(row["text"] if "text" in row else row["prompt"])
                except (ValueError, KeyError, TypeError):
                    raise CLIError(f"--prompts {file}, line {i}: not a JSON object with a \"text\" or a "
                                   f"\"prompt\"") from None
    if not all(isinstance(t, str) for t in texts):
        raise CLIError(f"--prompts {file}: a \"text\" or \"prompt\" that is not a string")
    tok = TextTokenizer(model)
    # each text cut into windows of prompt_len tokens; the first window of every text, then the second...
    windows = [[ids[i:i + prompt_len] for i in range(0, len(ids) - prompt_len + 1, prompt_len)]
               for ids in (tok.encode(t) for t in texts)]
    prompts = [w[r] for r in range(max(map(len, windows), default=0)) for w in windows if r < len(w)]
    if len(prompts) < n:
        raise CLIError(f"--prompts {file}: {len(prompts)} windows of {prompt_len} tokens in its texts, and the "
                       f"largest --batch needs {n}")
    return prompts[:n]


def decode(engine: LLMEngine, prompts: list[list[int]], new: int, temperature: float = 0.0) \
        -> tuple[list[list[int]], float, int, int]:
    """-> (each prompt's tokens, seconds decoding after every prompt has its first token, tokens made
    then, steps then)."""
    params = SamplingParams(max_tokens=new, temperature=temperature, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(not s.output_ids for s in seqs):
        engine.step()
    made, steps = sum(len(s.output_ids) for s in seqs), engine.loop.steps
    t = time.perf_counter()
    while engine.core.has_work():
        engine.step()
    seconds = time.perf_counter() - t
    return ([s.output_ids for s in seqs], seconds, sum(len(s.output_ids) for s in seqs) - made,
            engine.loop.steps - steps)


def run_speculative_bench(args) -> int:
    if args.new < 2:
        raise CLIError("--new must be at least 2 (decode steps are what is measured)")
    if args.lookup_min > args.lookup_max:
        raise CLIError(f"--lookup-min {args.lookup_min} is more than --lookup-max {args.lookup_max}")
    torch.set_num_threads(args.threads)
    mc = ModelConfig.from_dir(args.model)
    check_lengths(mc, args.prompt_len, args.new)
    dtype = resolve_dtype(args.dtype, mc)
    exact = dtype == "float32" and not args.quantization and args.temperature == 0  # (see the module)
    biggest = max(args.batch)
    prompts = load_prompts(args.prompts, args.model, biggest, args.prompt_len)
    baseline: dict[int, tuple[list[list[int]], float]] = {}
    for k in [0, *args.num_speculative_tokens]:
        engine = LLMEngine(EngineSettings(model=args.model, dtype=dtype, quantization=args.quantization,
                                          max_seqs=biggest, max_batched_tokens=max(512, biggest * args.prompt_len),
                                          num_kv_blocks=biggest * -(-(args.prompt_len + args.new) // 16) + biggest,
                                          num_speculative_tokens=k, ngram_prompt_lookup_min=args.lookup_min,
                                          ngram_prompt_lookup_max=args.lookup_max,
                                          speculative_disable_by_batch_size=biggest,
                                          speculative_sampling=k > 0 and args.temperature > 0), progress=None)
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        for batch in args.batch:
            best, stats = 0.0, None
            for _ in range(args.repeats):
                s = engine.scheduler
                drafted, accepted = s.num_drafted, s.num_accepted
                tokens, seconds, made, steps = decode(engine, prompts[:batch], args.new, args.temperature)
                if k == 0:
                    baseline.setdefault(batch, (tokens, 0.0))
                same = sum(a == b for a, b in zip(tokens, baseline[batch][0]))
                if same < batch and exact:
                    raise CLIError(f"batch {batch}, --num-speculative-tokens {k}: the tokens of {batch - same} "
                                   f"sequences differ from the run without drafts")
                if made / seconds > best:
                    best = made / seconds
                    stats = (s.num_accepted - accepted, s.num_drafted - drafted, made / steps, same)
            if k == 0:
                baseline[batch] = (baseline[batch][0], best)
            row = {"model": Path(args.model).name, "batch": batch, "num_speculative_tokens": k,
                   "tok_per_s": round(best, 1), "vs_baseline": round(best / baseline[batch][1], 3),
                   "acceptance": round(stats[0] / stats[1], 3) if stats[1] else None,
                   "tokens_per_step": round(stats[2] / batch, 2),
                   # (below float32 a step's rows can tip a near-tie: kernels/README.md)
                   **({} if exact or args.temperature else {"same_tokens": f"{stats[3]}/{batch}"}),
                   **({"temperature": args.temperature} if args.temperature else {})}
            print(json.dumps(row) if args.json else "  ".join(f"{key}={v}" for key, v in row.items()), flush=True)
        del engine
    return 0
