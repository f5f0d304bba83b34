"""`moemesh` command line: one place where flags become configs.

    moemesh make-tiny-model --arch mixtral --out DIR [sizes]
    moemesh generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F.jsonl) ...
    moemesh bench model --model DIR --batch 1,8,32,64 --new 64 --prompt-len 32 --threads 1 [--json]

A bad flag gets a one-line message naming it and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moemesh.config import DTYPES, ConfigError
from stage_worker.loader import LoadError


class CLIError(Exception):
    """A user error, reported as `moemesh: error: <message>`."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


positive_int.__name__ = "positive integer"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


int_list.__name__ = "comma-separated list of integers"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: float32 on CPU, the checkpoint's dtype on GPU")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    p.add_argument("--kv-memory", type=positive_int, default=1 << 30, help="bytes of KV cache (default 1 GiB)")
    p.add_argument("--max-batched-tokens", type=positive_int, default=512, help="token budget of one step")
    p.add_argument("--max-seqs", type=positive_int, default=256, help="sequences in one step at most")
    p.add_argument("--layer-partition", type=int_list, default=None,
                   help="layers per pipeline stage, e.g. 3,5 (in one process for now)")


SIZE_FLAGS = {  # make-tiny-model flag -> TinyModelSpec field
    "layers": "num_layers", "hidden": "hidden_size", "intermediate": "intermediate_size",
    "moe-intermediate": "moe_intermediate_size", "shared-intermediate": "shared_expert_intermediate_size",
    "heads": "num_heads", "kv-heads": "num_kv_heads", "head-dim": "head_dim", "experts": "num_experts",
    "top-k": "top_k", "vocab": "vocab_size", "max-positions": "max_position_embeddings",
    "decoder-sparse-step": "decoder_sparse_step", "seed": "seed", "max-shard-bytes": "max_shard_bytes"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moemesh", description="Serve Mixture-of-Experts models across hosts.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from moemesh.tiny_model import ARCHS, TinyModelSpec

    t = sub.add_parser("make-tiny-model", help="write a random Hugging Face-format checkpoint")
    t.add_argument("--arch", required=True, choices=ARCHS)
    t.add_argument("--out", required=True, type=Path)
    t.add_argument("--preset", choices=["default", "bench"], help="start from the built-in or benchmark sizes")
    defaults = TinyModelSpec(arch="mixtral")
    for flag, field in SIZE_FLAGS.items():
        t.add_argument(f"--{flag}", dest=field, type=int, default=None,
                       help=f"(default {getattr(defaults, field)})")
    t.add_argument("--mlp-only-layers", dest="mlp_only_layers", type=int_list, default=None)
    t.add_argument("--tie-embeddings", dest="tie_word_embeddings", action="store_true", default=None)
    t.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false", default=None)
    t.add_argument("--rope-theta", dest="rope_theta", type=float, default=None)
    t.add_argument("--dtype", dest="dtype", choices=list(DTYPES), default=None)

    g = sub.add_parser("generate", help="generate from prompts (in this process)")
    add_engine_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a text prompt (needs the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", type=int_list, help="a prompt as token ids, e.g. 1,2,3")
    src.add_argument("--prompts-file", type=Path,
                     help='JSON lines: {"prompt": "..."} or {"prompt_ids": [...]} per line')
    g.add_argument("--max-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    m = bsub.add_parser("model", help="decode throughput of the in-process engine vs transformers and the roofline")
    m.add_argument("--model", required=True)
    m.add_argument("--batch", type=int_list, default=[1, 8, 32, 64])
    m.add_argument("--new", type=positive_int, default=64, help="tokens generated per sequence")
    m.add_argument("--prompt-len", type=positive_int, default=32)
    m.add_argument("--threads", type=positive_int, default=1)
    m.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    m.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    m.add_argument("--json", action="store_true", help="one JSON line per (impl, batch)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from moemesh.log import setup_logging

    setup_logging(args.log_level)
    try:
        if args.command == "make-tiny-model":
            return cmd_make_tiny_model(args)
        if args.command == "generate":
            from moemesh.generate import run_generate

            return run_generate(args)
        if args.command == "bench" and args.bench == "model":
            from moemesh.bench.model import run_model_bench

            return run_model_bench(args)
    except (CLIError, ConfigError, LoadError) as e:
        parser.exit(2, f"moemesh: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_make_tiny_model(args) -> int:
    from dataclasses import fields, replace

    from moemesh.tiny_model import BENCH_SPEC, DEFAULT_SPEC, TinyModelSpec, write_tiny_model

    base = {"bench": BENCH_SPEC, "default": DEFAULT_SPEC}.get(args.preset) or TinyModelSpec(arch=args.arch)
    overrides = {f.name: getattr(args, f.name) for f in fields(TinyModelSpec)
                 if f.name != "arch" and getattr(args, f.name, None) is not None}
    if "mlp_only_layers" in overrides:
        overrides["mlp_only_layers"] = tuple(overrides["mlp_only_layers"])
    try:
        spec = replace(base, arch=args.arch, **overrides)
    except ValueError as e:
        message = str(e)
        for flag, field in SIZE_FLAGS.items():
            message = message.replace(field, f"--{flag}")
        raise CLIError(message) from None
    out = write_tiny_model(spec, args.out)
    print(out)
    return 0

