"""`moemesh` command line: the commands, their flags from the settings classes (moemesh/settings.py).

    moemesh serve [--model DIR] [--pp N] [--tp M] [--port 8000]       everything on this machine
    moemesh gateway --coordinator tcp://HOST:PORT [--port 8000]       the HTTP front
    moemesh coordinator --model DIR --pp N --tp M [--layer-partition 3,5]
    moemesh stage-worker --coordinator tcp://HOST:PORT --pp-rank R [--tp-rank T]
    moemesh generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F.jsonl) [--pp N]
    moemesh keys --out DIR                                             CurveZMQ keys for --mesh-keys
    moemesh make-tiny-model --arch mixtral --out DIR [sizes]
    moemesh train-demo --out DIR                                      the built-in model, trained on the stdlib
    moemesh eval-demo --lm-eval PATH                                  its accuracy table, through the HTTP API
    moemesh bench model | throughput | scheduler | serve ...

A bad flag gets a one-line message naming it and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path

from moemesh.config import DTYPES, MOE_BACKENDS, QUANTIZATIONS
from moemesh.errors import CLIError, ConfigError, LoadError
from moemesh.settings import (CoordinatorSettings, EngineSettings, GatewaySettings, LaunchSettings, LogSettings,
                              StageSettings, StandaloneSettings, WorkerSettings, int_list, non_negative_int,
                              SchedulerSettings, partition_arg, positive_float, positive_int, positive_int_list,
                              threads_int, byte_count, seed_int)


def backend_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in MOE_BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(MOE_BACKENDS)}")
    return names


backend_list.__name__ = "comma-separated list of backends"


def on_off_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or any(v not in ("on", "off") for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: on, off, or on,off")
    return values


on_off_list.__name__ = "on, off or on,off"


# make-tiny-model's size flags that only some architectures have
UNUSED_SIZES = {"experts": ("mixtral", "qwen2_moe", "qwen3_moe"), "top-k": ("mixtral", "qwen2_moe", "qwen3_moe"),
                "moe-intermediate": ("qwen2_moe", "qwen3_moe"), "shared-intermediate": ("qwen2_moe",)}
SIZE_FLAGS = {  # make-tiny-model flag -> TinyModelSpec field
    "layers": "num_layers", "hidden": "hidden_size", "intermediate": "intermediate_size",
    "moe-intermediate": "moe_intermediate_size", "shared-intermediate": "shared_expert_intermediate_size",
    "heads": "num_heads", "kv-heads": "num_kv_heads", "head-dim": "head_dim", "experts": "num_experts",
    "top-k": "top_k", "vocab": "vocab_size", "max-positions": "max_position_embeddings",
    "decoder-sparse-step": "decoder_sparse_step", "seed": "seed", "max-shard-bytes": "max_shard_bytes"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moemesh", description="Serve Mixture-of-Experts models across hosts.")
    LogSettings.add_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from moemesh.entrypoints.tiny_model import ARCHS, TinyModelSpec

    t = sub.add_parser("make-tiny-model", help="write a random Hugging Face-format checkpoint")
    t.add_argument("--arch", required=True, choices=ARCHS)
    t.add_argument("--out", required=True, type=out_path)
    t.add_argument("--preset", choices=["default", "bench"],
                   help="start from these sizes (default: 4 layers, hidden 256, 8 experts, vocabulary 1024, random "
                        "weights, not the trained demo model `serve` ships; bench: the benchmark model of "
                        "docs/benchmarks.md; without --preset: each flag's own default below); the flags below "
                        "change them")
    defaults = TinyModelSpec(arch="mixtral")
    for flag, field in SIZE_FLAGS.items():
        t.add_argument(f"--{flag}", dest=field, type=seed_int if flag == "seed" else positive_int, default=None,
                       help=f"(default: the preset's, else {getattr(defaults, field)})")
    t.add_argument("--mlp-only-layers", dest="mlp_only_layers", type=int_list, default=None)
    t.add_argument("--tie-embeddings", dest="tie_word_embeddings", action="store_true", default=None)
    t.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false", default=None)
    t.add_argument("--rope-theta", dest="rope_theta", type=float, default=None)
    t.add_argument("--dtype", dest="dtype", choices=list(DTYPES), default=None)

    g = sub.add_parser("generate", help="generate from prompts (in this process, or on a local mesh with --pp/--tp)")
    EngineSettings.add_arguments(g, environ={}, pp={"default": None, "help": "run on a local mesh: a coordinator and "
                                                                               "this many pipeline stages as processes"},
                                 tp={"help": "tensor-parallel ranks per stage (runs on a mesh)"},
                                 max_in_flight={"help": "microbatches in the pipeline at once (default: pp)"})
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
    g.add_argument("--seed", type=seed_int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")


    c = sub.add_parser("coordinator", help="run the coordinator of a mesh")
    CoordinatorSettings.add_arguments(
        c, model={"required": True, "help": "checkpoint directory (workers read it at the same path)"},
        port={"default": 5555, "help": "port for stage workers (0: any free port)"},
        client_port={"default": 5556, "help": "port for gateways and clients (0: any)"})

    w = sub.add_parser("stage-worker", help="run one stage worker of a mesh (or one stage alone, --standalone)")
    WorkerSettings.add_arguments(w, kv_memory={"help": "bytes of KV cache"},
                                 threads={"help": "compute threads (default: the cores this process may use)"})
    StandaloneSettings.add_arguments(w)

    st = sub.add_parser("stage", help="run the tensor-parallel workers of one pipeline stage on this host")
    StageSettings.add_arguments(
        st, coordinator={"required": True}, pp_rank={"required": True}, tp_rank=None, record=None,
        port={"help": "activation port of tensor rank 0; rank i listens on PORT + i (0: any free ports), so a "
                      "firewall can open just those"},
        record_steps=None, device={"help": "cpu or cuda (worker i on cuda:i)", "choices": ("cpu", "cuda")},
        host={"default": "0.0.0.0", "help": "address the activation sockets listen on"},
        kv_memory={"help": "bytes of KV cache per worker"},
        threads={"help": "compute threads per worker (default: this host's cores shared among the --tp workers)"})

    k = sub.add_parser("keys", help="make the CurveZMQ keys of a mesh (for --mesh-keys)")
    k.add_argument("--out", required=True, type=out_path, help="the directory to write them to (must not hold keys)")
    k.add_argument("--gateway-out", type=out_path, metavar="DIR",
                   help="also copy there only what a gateway's host needs (server.key, client.key_secret), again "
                        "on every run")
    k.add_argument("--stage-out", type=out_path, metavar="DIR",
                   help="also copy there only what a stage host needs (the server key pair, worker.key_secret, "
                        "workers/), again on every run")
    k.add_argument("--if-missing", action="store_true", help="keys already there are fine: keep them (for a "
                                                            "one-shot container that runs at every start)")

    td = sub.add_parser("train-demo", help="train the built-in demo model on the standard library (CPU: about 20 min on 2 idle cores)")
    td.add_argument("--out", type=out_path, help="where to write the checkpoint (the shipped one: moemesh/demo_model)")
    td.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default 800)")
    td.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (default 8)")
    td.add_argument("--lr", type=positive_float, default=None, help="peak learning rate (default 2e-3)")
    td.add_argument("--seed", type=seed_int, default=None, help="(default 0)")
    td.add_argument("--threads", type=threads_int, default=None, help="torch threads (default 2)")
    td.add_argument("--log-every", type=positive_int, default=None, help="steps per progress line (default 10)")
    td.add_argument("--stdlib", type=Path, default=None, help="the standard library to read (default: this Python's)")
    td.add_argument("--write-eval-data", type=Path, default=None, metavar="DIR",
                    help="instead of training, write the held-out files and the next-line task as JSONL to DIR")

    ev = sub.add_parser("eval-demo", help="the accuracy table: moemesh serve per row, lm-eval through the API")
    ev.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    ev.add_argument("--lm-eval", default="lm_eval", help="lm-eval's command (a path, or a name on PATH)")
    ev.add_argument("--rows", default=None, help="comma-separated subset of transformers,float32,bfloat16,fp8,"
                                                 "autofp8,int8 (default: all)")
    ev.add_argument("--pp", default="1,2", help="pipeline stages of each row, e.g. 1,2")
    ev.add_argument("--limit", type=positive_int, default=None, help="only the first N documents of each task")
    ev.add_argument("--concurrency", type=positive_int, default=8, help="lm-eval's requests in flight (1: every "
                                                                       "step holds one sequence)")
    ev.add_argument("--work-dir", type=Path, default=None, help="servers' logs and lm-eval's output (default: a "
                                                                 "temporary directory)")
    ev.add_argument("--out", type=out_path, default=None, help="also write the table (markdown) here")

    q = sub.add_parser("quantize", help="write an FP8 copy of a checkpoint (AutoFP8's layout)")
    q.add_argument("--model", required=True, help="checkpoint directory (16/32-bit)")
    q.add_argument("--out", required=True, type=out_path, help="where to write the FP8 checkpoint")

    gw = sub.add_parser("gateway", help="run an OpenAI-compatible HTTP gateway in front of a coordinator")
    GatewaySettings.add_arguments(gw, coordinator={"required": True})

    sv = sub.add_parser("serve", help="start coordinator, stage workers and gateway on this machine")
    EngineSettings.add_arguments(sv, pp={"default": None, "help": "pipeline stages (default: as many as "
                                                                 "--layer-partition gives, or 1)"})
    GatewaySettings.add_arguments(sv, coordinator=None, model=None, mesh_keys=None, insecure_mesh=None)
    LaunchSettings.add_arguments(sv)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    m = bsub.add_parser("model", help="decode throughput of the in-process engine vs transformers and the roofline")
    m.add_argument("--model", required=True)
    m.add_argument("--batch", type=int_list, default=[1, 8, 32, 64])
    m.add_argument("--new", type=positive_int, default=64, help="tokens generated per sequence")
    m.add_argument("--prompt-len", type=positive_int, default=32)
    m.add_argument("--threads", type=threads_int, default=1)
    m.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    m.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    m.add_argument("--moe-backend", type=backend_list, default=["auto"],
                   help="kernels to measure, one engine each in this run, e.g. native,torch (the first is "
                        "compared with the others)")
    m.add_argument("--num-scheduler-steps", type=positive_int, default=1,
                   help="decode steps per schedule (as serve's flag; 1: a schedule per step)")
    m.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    m.add_argument("--json", action="store_true", help="one JSON line per (impl, batch)")
    spb = bsub.add_parser("speculative", help="decode speed with prompt-lookup drafts (--num-speculative-tokens) "
                                              "against the same engine without them, on text prompts")
    spb.add_argument("--model", required=True)
    spb.add_argument("--prompts", default=None, help="JSON lines, each with a \"text\" or a \"prompt\" (default: the "
                                                     "repository's eval/demo/heldout.jsonl)")
    spb.add_argument("--batch", type=positive_int_list, default=[1, 8])
    spb.add_argument("--prompt-len", type=positive_int, default=256, help="tokens of each text the prompt keeps")
    spb.add_argument("--new", type=positive_int, default=128, help="tokens generated per prompt")
    spb.add_argument("--num-speculative-tokens", type=positive_int_list, default=[2, 3, 4],
                     help="draft lengths measured, each against no drafts")
    spb.add_argument("--lookup-min", type=positive_int, default=EngineSettings.ngram_prompt_lookup_min,
                     help="as serve's --ngram-prompt-lookup-min")
    spb.add_argument("--lookup-max", type=positive_int, default=EngineSettings.ngram_prompt_lookup_max,
                     help="as serve's --ngram-prompt-lookup-max")
    spb.add_argument("--threads", type=threads_int, default=1)
    spb.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    spb.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    spb.add_argument("--temperature", type=_temperature, default=0.0,
                     help="sample at this temperature (0: greedy, every run's tokens checked against the baseline's)")
    spb.add_argument("--repeats", type=positive_int, default=3, help="runs of each figure; the best is printed")
    spb.add_argument("--json", action="store_true", help="one JSON line per (batch, draft length)")
    tb = bsub.add_parser("throughput", help="offline throughput of the mesh per layout, vs the in-process engine")
    tb.add_argument("--model", required=True)
    tb.add_argument("--pp", type=positive_int_list, default=[1, 2], help="pipeline stages of each layout, e.g. 1,2")
    tb.add_argument("--tp", type=positive_int_list, default=[1], help="tensor-parallel ranks of each layout, e.g. 1,2")
    tb.add_argument("--expert-parallel", action="store_true")
    tb.add_argument("--layer-partition", type=partition_arg, default=None,
                    help="auto or auto:PROMPT:OUTPUT: balanced stages for every --pp (e.g. auto:32:64 for this "
                         "benchmark's default mix); or layers per stage for the layout with that many")
    tb.add_argument("--partition-costs", choices=["measured", "weights"], default="measured",
                    help="what auto balances: each layer's and the head's cost measured here for a microbatch of "
                         "this benchmark (--concurrency shared among the stages), or the weights' multiply-adds")
    tb.add_argument("--concurrency", type=positive_int, default=64, help="requests in flight at once")
    tb.add_argument("--num-prompts", type=positive_int, default=None, help="(default: --concurrency)")
    tb.add_argument("--prompt-len", type=positive_int, default=32)
    tb.add_argument("--new", type=positive_int, default=64, help="tokens generated per request")
    tb.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    tb.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS))
    tb.add_argument("--kv-memory", type=byte_count, default=256 << 20, help="KV-cache bytes per worker")
    tb.add_argument("--max-batched-tokens", type=positive_int, default=SchedulerSettings.max_batched_tokens,
                    help="token budget of one step (default: the servers' own)")
    tb.add_argument("--max-in-flight", type=positive_int, default=None,
                    help="microbatches in the pipeline at once, in every layout (default: each layout's stages)")
    tb.add_argument("--shared-prefix", type=non_negative_int, default=0, metavar="P",
                    help="every prompt starts with the same P random tokens (the prefix-caching workload)")
    tb.add_argument("--prefix-caching", type=on_off_list, default=["on"],
                    help="on, off, or on,off: run each layout with and without the prefix cache and compare")
    tb.add_argument("--mlp-handoff", type=on_off_list, default=["on"],
                    help="on, off, or on,off: run each layout of two stages or more with the MLP hand-off (as "
                         "serve does), without it (--no-mlp-handoff), or both and compare")
    tb.add_argument("--curve", type=on_off_list, default=["off"],
                    help="on, off, or on,off: run each layout with CurveZMQ on every mesh socket (fresh keys), "
                         "without, or both and compare")
    tb.add_argument("--no-baseline", action="store_true", help="skip the in-process engine")
    tb.add_argument("--ceiling", action="store_true",
                    help="also run N independent in-process engines at once (N = each layout's workers, each "
                         "holding the whole model), the prompts split among them: what the cores do with no "
                         "pipeline; layouts print vs_ceiling")
    tb.add_argument("--netns", action="store_true", help="run each layout across simulated hosts (network "
                                                         "namespaces; needs root): coordinator and each stage apart")
    tb.add_argument("--timeline", default=None, metavar="DIR",
                    help="write each layout's steps, stage by stage, as a trace file in DIR (open it in "
                         "ui.perfetto.dev or chrome://tracing) and print each stage's idle time before steps with "
                         "prompt tokens and before decode steps, and the median time of each hand-over of a decode "
                         "step: stage to stage, the last stage's result to the coordinator, the coordinator's "
                         "turn to its next schedule, that schedule to the first stage")
    tb.add_argument("--rounds", type=positive_int, default=1,
                    help="run the baseline, the ceilings and every layout this many times over, one round after "
                         "the other, then print each figure's median and the median of each round's ratios")
    tb.add_argument("--json", action="store_true", help="one JSON line per layout")
    fb = bsub.add_parser("fp8", help="logit error and greedy agreement of FP8 (and int8) against the unquantized "
                                     "model")
    fb.add_argument("--model", required=True, help="the 16/32-bit checkpoint")
    fb.add_argument("--quantization", type=lambda t: [x for x in t.split(",") if x], default=["fp8"],
                    help="quantizations applied in place and compared: fp8, int8 or fp8,int8")
    fb.add_argument("--fp8-model", default=None, help="its FP8 checkpoint (moemesh quantize), compared as well")
    fb.add_argument("--num-prompts", type=positive_int, default=16)
    fb.add_argument("--prompt-len", type=positive_int, default=16)
    fb.add_argument("--new", type=positive_int, default=32)
    fb.add_argument("--threads", type=threads_int, default=1)
    fb.add_argument("--json", action="store_true")

    rb = bsub.add_parser("recovery", help="what losing a stage worker costs: the gap, requests lost, throughput")
    rb.add_argument("--model", required=True)
    rb.add_argument("--pp", type=positive_int, default=2, help="pipeline stages")
    rb.add_argument("--kill-stage", type=int, default=None, help="the stage whose worker is killed (default: the "
                                                                 "last)")
    rb.add_argument("--concurrency", type=positive_int, default=32, help="streams, all at once")
    rb.add_argument("--prompt-len", type=positive_int, default=32)
    rb.add_argument("--new", type=positive_int, default=128, help="tokens generated per stream")
    rb.add_argument("--kv-memory", type=byte_count, default=256 << 20, help="KV-cache bytes per worker")
    rb.add_argument("--worker-timeout", type=positive_float, default=5.0, help="the coordinator's heartbeat timeout")
    rb.add_argument("--json", action="store_true")

    cb = bsub.add_parser("scheduler", help="the coordinator's CPU time and schedule bytes per decode step, by "
                                           "context length (no model)")
    cb.add_argument("--seqs", type=positive_int, default=256, help="running sequences")
    cb.add_argument("--context", type=positive_int_list, default=[32, 512, 2048],
                    help="prompt lengths, e.g. 32,512,2048")
    cb.add_argument("--steps", type=positive_int, default=200, help="decode steps measured")
    cb.add_argument("--block-size", type=positive_int, default=16)
    cb.add_argument("--in-flight", type=positive_int, default=1, help="microbatches in flight (a pipeline's stages)")
    cb.add_argument("--json", action="store_true")

    sb = bsub.add_parser("serve", help="latency and throughput of a running server over HTTP")
    sb.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    sb.add_argument("--concurrency", type=positive_int_list, default=[64],
                    help="requests in flight; a list gives a curve")
    sb.add_argument("--num-prompts", type=positive_int, default=200)
    sb.add_argument("--request-rate", type=positive_float, default=None,
                    help="Poisson arrivals per second (default: all at once)")
    sb.add_argument("--prompt-len", type=positive_int, default=32,
                    help="prompt tokens of each request (after the shared prefix, if any)")
    sb.add_argument("--shared-prefix", type=non_negative_int, default=0, metavar="P",
                    help="every prompt starts with the same P random tokens (the prefix-caching workload)")
    sb.add_argument("--model-name", default=None, help="the request's \"model\" field (some servers want one)")
    sb.add_argument("--new", type=positive_int, default=64)
    sb.add_argument("--vocab", type=positive_int, default=1000, help="prompt token ids are drawn below this")
    sb.add_argument("--seed", type=seed_int, default=0)
    sb.add_argument("--api-key", default=None)
    sb.add_argument("--json", action="store_true", help="one JSON line per concurrency level")
    sb.add_argument("--plot", default=None, help="write a latency-vs-throughput plot (PNG)")
    _log_level_anywhere(parser)
    return parser


def _temperature(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 2:  # (OpenAI's range)
        raise ValueError
    return value


_temperature.__name__ = "temperature (0 to 2)"


def _log_level_anywhere(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format after the command as well as before it (`moemesh serve --log-level
    info`): every subcommand takes them too, leaving the top-level value alone unless given there."""
    for spec in LogSettings.flags():
        option = "--" + spec.name.replace("_", "-")
        choices = spec.metadata["flag"].choices
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    if option not in sub._option_string_actions:
                        sub.add_argument(option, dest=spec.name, default=argparse.SUPPRESS, choices=choices,
                                         type=str.lower, help=spec.metadata["flag"].help + " (as before the command)")
                    _log_level_anywhere(sub)


def out_path(text: str) -> Path:
    """An output path: not empty (which would write into the current directory)."""
    if not text.strip():
        raise ValueError(text)
    return Path(text)


out_path.__name__ = "path (not empty)"


def _exit_terminated(signum, frame) -> None:
    # the status SIGTERM's default action gives; the kernel then kills whatever is left in the namespace
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    on_term = signal.getsignal(signal.SIGTERM)
    if os.getpid() == 1 and on_term == signal.SIG_DFL:
        # a container's first process (docker without --init, a Kubernetes pod): the kernel does not
        # apply SIGTERM's default action to a namespace's init, so `docker stop` and a pod's deletion
        # would wait out their grace period and kill it. It ends on SIGTERM here as it does anywhere
        # else.
        signal.signal(signal.SIGTERM, _exit_terminated)
    backend = getattr(args, "moe_backend", None)  # (`bench model` takes a list)
    if (backend == "triton" or isinstance(backend, list) and "triton" in backend) \
            and getattr(args, "device", "cpu") == "cpu":
        # Triton kernels run on CPU tensors only in its interpreter, chosen when they are defined;
        # child processes (the mesh) inherit it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from moemesh.log import setup_logging

    setup_logging(args.log_level, args.log_format)
    logs = {"MOEMESH_LOG_LEVEL": args.log_level, "MOEMESH_LOG_FORMAT": args.log_format}
    before = {var: os.environ.get(var) for var in logs}
    os.environ.update(logs)  # the processes it starts log at the same level, in the same format
    try:
        return _command(parser, args, sys.argv[1:] if argv is None else argv)
    finally:  # (main may run inside another program, as the tests run it)
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        if signal.getsignal(signal.SIGTERM) is _exit_terminated:
            signal.signal(signal.SIGTERM, on_term)


def _from_environment(message: str, argv: list[str], args: argparse.Namespace | None = None) -> str:
    """An error that names a flag the command line did not give, whose value came from its MOEMESH_*
    variable: the message says so (the user never typed that flag)."""
    for flag in dict.fromkeys(re.findall(r"--[a-z][a-z0-9-]*", message)):
        var = "MOEMESH_" + flag[2:].upper().replace("-", "_")
        given = any(a == flag or a.startswith(flag + "=") for a in argv)
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        # (the command took the variable: its value is the flag's; a command without it left it alone)
        if not given and var in os.environ and value is not None and str(value) == os.environ[var].strip():
            return f"{message} ({flag} from {var}={os.environ[var]!r})"
    return message


# pyproject.toml's extras, by the modules a command may find missing
EXTRAS = {"worker": ("torch", "triton", "safetensors", "numpy"), "bench": ("transformers", "matplotlib"),
          "eval": ("lm_eval",)}


def _command(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] = ()) -> int:
    try:
        if args.command == "make-tiny-model":
            return cmd_make_tiny_model(args)
        if args.command == "generate":
            from moemesh.entrypoints.generate import run_generate

            return run_generate(args)
        if args.command == "gateway":
            return cmd_gateway(args)
        if args.command == "stage":
            return cmd_stage(args)
        if args.command == "keys":
            from moemesh.mesh_security import copy_keys, make_keys

            if not (args.if_missing and (args.out / "server.key_secret").is_file()):
                try:
                    make_keys(args.out)
                except OSError as e:
                    raise CLIError(f"--out {args.out}: {e.strerror or e}") from None
            for host, flag in (("gateway", "--gateway-out"), ("stage", "--stage-out")):
                out = getattr(args, f"{host}_out")
                if out is not None:
                    try:
                        copy_keys(args.out, out, host)
                    except OSError as e:
                        raise CLIError(f"{flag} {out}: {e.strerror or e}") from None
            print(args.out)
            return 0
        if args.command == "train-demo":
            from moemesh.entrypoints.train_demo import run_train_demo

            return run_train_demo(args)
        if args.command == "eval-demo":
            from moemesh.entrypoints.eval_demo import run_eval_demo

            return run_eval_demo(args)
        if args.command == "quantize":
            from safetensors import SafetensorError

            from moemesh.config import ModelConfig
            from moemesh.entrypoints.quantize import quantize_checkpoint

            ModelConfig.from_dir(args.model)  # (a missing or broken checkpoint named before any work)
            try:
                print(quantize_checkpoint(args.model, args.out))
            except OSError as e:
                # a path in --out, or a parent of it that could not be made (not the checkpoint's directory
                # or one of its parents, which exist)
                where, out_dir = Path(e.filename or "").resolve(), args.out.resolve()
                out = bool(e.filename) and (where.is_relative_to(out_dir) or (
                    out_dir.is_relative_to(where) and not Path(args.model).resolve().is_relative_to(where)))
                raise CLIError(f"{'--out ' + str(args.out) if out else '--model ' + str(args.model)}: "
                               f"{e.strerror or e}") from None
            except (ValueError, SafetensorError) as e:  # the checkpoint cannot be quantized (as it says)
                message = str(e).replace("out_dir", "--out").replace("model_dir", "--model")
                raise CLIError(message if message.startswith("--out") else f"--model {args.model}: {message}") \
                    from None
            return 0
        if args.command == "serve":
            from moemesh.entrypoints.serve import run_serve

            return run_serve(args)
        if args.command == "coordinator":
            return cmd_coordinator(args)
        if args.command == "stage-worker":
            return cmd_stage_worker(args)
        if args.command == "bench" and args.bench == "fp8":
            from moemesh.entrypoints.bench.fp8 import run_fp8_bench

            return run_fp8_bench(args)
        if args.command == "bench" and args.bench == "recovery":
            from moemesh.entrypoints.bench.recovery import run_recovery_bench

            if args.kill_stage is None:
                args.kill_stage = args.pp - 1
            return run_recovery_bench(args)
        if args.command == "bench" and args.bench == "scheduler":
            from moemesh.entrypoints.bench.scheduler import run_scheduler_bench

            return run_scheduler_bench(args)
        if args.command == "bench" and args.bench == "serve":
            from moemesh.entrypoints.bench.serve import run_serve_bench

            return run_serve_bench(args)
        if args.command == "bench" and args.bench == "throughput":
            from moemesh.entrypoints.bench.throughput import run_throughput_bench

            return run_throughput_bench(args)
        if args.command == "bench" and args.bench == "speculative":
            from moemesh.entrypoints.bench.speculative import run_speculative_bench

            return run_speculative_bench(args)
        if args.command == "bench" and args.bench == "model":
            from moemesh.entrypoints.bench.model import run_model_bench

            return run_model_bench(args)
    except (CLIError, ConfigError, LoadError) as e:
        parser.exit(2, f"moemesh: error: {_from_environment(str(e), argv, args)}\n")
    except ModuleNotFoundError as e:  # (a control-plane install, without its extras: `pip install moemesh`)
        top = (e.name or "").split(".")[0]
        extra = next((extra for extra, names in EXTRAS.items() if top in names), None)
        if extra is None:
            raise
        command = " ".join(a for a in (args.command, getattr(args, "bench", None)) if a)
        parser.exit(2, f"moemesh: error: moemesh {command} needs {top}, which this install lacks: "
                       f"pip install 'moemesh[{extra}]'\n")
    except KeyboardInterrupt:
        return 130
    except (OSError, UnicodeError) as e:  # a path or a file no check above named
        logging.getLogger("moemesh").debug("command failed", exc_info=True)
        parser.exit(2, f"moemesh: error: {e}\n")
    return 0


def cmd_coordinator(args) -> int:
    from coordinator.server import Coordinator
    from moemesh.netutil import run

    try:
        coord = Coordinator(CoordinatorSettings.from_args(args))
    except ValueError as e:
        raise CLIError(str(e)) from None
    run(coord.run())
    if coord.failure:
        print(f"moemesh: error: the pipeline went down: {coord.failure}", file=sys.stderr)
        return 1
    return 0


def cmd_stage(args) -> int:
    from moemesh.entrypoints.launcher import run_stage, threads_per_worker

    from moemesh.mesh_security import check_exposure

    stage = StageSettings.from_args(args)
    if stage.port and stage.port + stage.tp - 1 > 65535:
        raise CLIError(f"--port {stage.port} --tp {stage.tp}: the ranks would listen on ports up to "
                       f"{stage.port + stage.tp - 1}, past 65535")
    # before any worker starts (each would refuse alone, and a restart policy would start them again)
    check_exposure(stage.mesh_keys, stage.insecure_mesh, host=stage.host, coordinator=stage.coordinator)
    from moemesh_kernels.backend import check_device

    if stage.device == "cuda":  # (rank i on cuda:i)
        check_device(f"cuda:{stage.tp - 1}", f"--device cuda, one GPU for each of the --tp {stage.tp} ranks, needs")
    else:
        check_device(stage.device)
    return run_stage(StageSettings.derive(stage, threads=threads_per_worker(stage.threads, stage.tp)))


def cmd_gateway(args) -> int:
    from gateway.server import run_gateway, ssl_context
    from moemesh.client import PipelineFailed
    from moemesh.netutil import run

    cfg = GatewaySettings.from_args(args)
    ssl_context(cfg)  # (a bad certificate or key now, not once the pipeline serves)
    if cfg.model is not None and not (Path(cfg.model) / "tokenizer.json").is_file():  # (now, not once it serves)
        raise CLIError(f"--model {cfg.model}: no tokenizer.json there (the gateway reads the tokenizer and chat "
                       f"template from the model's directory)")
    try:
        run(run_gateway(cfg), stop_on_sigterm=True)
    except (PipelineFailed, TimeoutError) as e:
        raise CLIError(f"--coordinator {cfg.coordinator}: {e}") from None
    return 0


def cmd_stage_worker(args) -> int:
    from moemesh.entrypoints.launcher import threads_per_worker
    from moemesh.netutil import run
    from stage_worker.worker import StageWorker

    if args.standalone:
        return cmd_standalone(args)
    if args.coordinator is None or args.pp_rank is None:
        raise CLIError("stage-worker needs --coordinator and --pp-rank (or --standalone)")
    from moemesh_kernels.backend import check_device

    check_device(args.device)
    code = run(StageWorker(WorkerSettings.from_args(args, threads=threads_per_worker(args.threads, 1))).run())
    # exit now: the compute thread may still be in a collective with a peer that is gone, and the
    # interpreter would wait for it at exit (told to exit, this worker's launcher starts it again)
    logging.shutdown()
    os._exit(code)


def cmd_standalone(args) -> int:
    import torch

    from moemesh.config import ModelConfig
    from stage_worker.standalone import check_synthetic_step, run_standalone

    from stage_worker.standalone import recorded_run

    recorded = recorded_run(args.replay).get("layers") if args.replay else None
    if args.model is None or (args.layers is None and recorded is None):
        raise CLIError("--standalone needs --model DIR and --layers A:B (a --replay recording says its own)")
    try:
        a, b = (int(x) for x in args.layers.split(":")) if args.layers is not None else recorded
    except (ValueError, TypeError):
        raise CLIError(f"--layers {args.layers!r}: expected A:B, e.g. 0:4") from None
    if recorded is not None and [a, b] != list(recorded):
        raise CLIError(f"--layers {a}:{b}: the --replay recording is of layers {recorded[0]}:{recorded[1]} "
                       f"(leave --layers out to replay those)")
    mc = ModelConfig.from_dir(args.model)
    n = mc.num_layers
    if a >= b:
        raise CLIError(f"--layers {a}:{b} holds no layer (A:B runs from layer A up to, not including, B)")
    if not 0 <= a < b <= n:
        raise CLIError(f"--layers {a}:{b} is outside the model's 0:{n}")
    if args.replay is None:  # the synthetic step: every sequence a token at least, each within the positions
        check_synthetic_step(args.tokens, args.seqs, mc.max_position_embeddings)
    if args.tp_rank:
        raise CLIError("--standalone runs one process: tensor parallelism needs the mesh (leave --tp-rank out)")
    if args.replay is not None and not any(Path(args.replay).glob("step-*.schedule")):
        raise CLIError(f"--replay {args.replay}: no recorded steps (step-*.schedule) there")
    from moemesh_kernels.backend import check_device
    from moemesh_kernels.memory import use_huge_pages
    from moemesh.entrypoints.launcher import threads_per_worker

    check_device(args.device)  # (it was ignored: a GPU host's timings were the CPU's, without a word)
    torch.set_num_threads(threads_per_worker(args.threads, 1))
    use_huge_pages(not args.no_huge_pages)
    try:
        return run_standalone(args.model, range(a, b), args.replay, args.tokens, args.seqs, dtype=args.dtype,
                              quantization=args.quantization, moe_backend=args.moe_backend, device=args.device)
    except FileNotFoundError as e:
        raise CLIError(f"--replay: {e}") from None


def cmd_make_tiny_model(args) -> int:
    from dataclasses import fields, replace

    from moemesh.entrypoints.tiny_model import BENCH_SPEC, DEFAULT_SPEC, TinyModelSpec, write_tiny_model

    base = {"bench": BENCH_SPEC, "default": DEFAULT_SPEC}.get(args.preset) or TinyModelSpec(arch=args.arch)
    overrides = {f.name: getattr(args, f.name) for f in fields(TinyModelSpec)
                 if f.name != "arch" and getattr(args, f.name, None) is not None}
    if "mlp_only_layers" in overrides:
        overrides["mlp_only_layers"] = tuple(overrides["mlp_only_layers"])
    for flag, archs in UNUSED_SIZES.items():  # (said, not refused: one command line for every --arch)
        if SIZE_FLAGS[flag] in overrides and args.arch not in archs:
            logging.getLogger("moemesh").warning(f"--{flag} applies to {', '.join(archs)} only: --arch {args.arch} "
                                                 f"has none, and ignores it")
    try:
        spec = replace(base, arch=args.arch, **overrides)
    except ValueError as e:
        message = str(e)
        for flag, field in [*SIZE_FLAGS.items(), ("mlp-only-layers", "mlp_only_layers"), ("rope-theta", "rope_theta")]:
            message = re.sub(rf"\b{field}\b", f"--{flag}", message)
        raise CLIError(message) from None
    try:
        out = write_tiny_model(spec, args.out)
    except OSError as e:
        raise CLIError(f"--out {args.out}: {e.strerror or e}") from None
    except ValueError as e:  # (sizes this host cannot hold)
        raise CLIError(f"{e}: lower --hidden, --intermediate, --moe-intermediate, --experts, --vocab or "
                       f"--layers") from None
    print(out)
    return 0

