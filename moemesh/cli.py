"""`moemesh` command line: one place where flags become configs.

    moemesh serve [--model DIR] [--pp N] [--tp M] [--port 8000]       everything on this machine
    moemesh gateway --coordinator tcp://HOST:PORT [--port 8000]       the HTTP front
    moemesh coordinator --model DIR --pp N --tp M [--layer-partition 3,5]
    moemesh stage-worker --coordinator tcp://HOST:PORT --pp-rank R [--tp-rank T]
    moemesh generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F.jsonl) [--pp N]
    moemesh make-tiny-model --arch mixtral --out DIR [sizes]
    moemesh bench model | throughput | serve ...

A bad flag gets a one-line message naming it and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kernels.backend import BACKENDS
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


def partition_arg(text: str):
    """--layer-partition: "auto" or layers per stage, e.g. 3,5."""
    return "auto" if text.strip() == "auto" else int_list(text)


partition_arg.__name__ = "auto or a comma-separated list of integers"


def resolve_partition(value, model_dir, pp: int) -> tuple[int, ...] | None:
    """--layer-partition as layers per stage: "auto" balances the stages' decode cost for `pp`."""
    if value is None:
        return None
    if value == "auto":
        from moemesh.config import ConfigError, ModelConfig, balanced_partition

        try:
            return balanced_partition(ModelConfig.from_dir(model_dir), pp)
        except ConfigError as e:
            raise CLIError(f"--layer-partition auto: {e}") from None
    return tuple(value)


def backend_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: each must be one of {', '.join(BACKENDS)}")
    return names


backend_list.__name__ = "comma-separated list of backends"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: float32 on CPU, the checkpoint's dtype on GPU")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    p.add_argument("--kv-memory", type=positive_int, default=1 << 30,
                   help="bytes of KV cache (default 1 GiB): per stage worker on a mesh, for all layers in one process")
    p.add_argument("--max-batched-tokens", type=positive_int, default=512, help="token budget of one step")
    p.add_argument("--max-seqs", type=positive_int, default=256, help="sequences in one step at most")
    p.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                   help="fp8: quantize the weights to float8 at load (FP8 checkpoints need no flag); "
                        "int8: weight-only int8 with per-row scales (fast with the native CPU kernels)")
    p.add_argument("--moe-backend", default="auto", choices=list(BACKENDS),
                   help="the kernels: auto = Triton on CUDA, native C kernels on CPU (torch where no C compiler); "
                        "native: packed-weight CPU kernels for experts and linear layers; torch: torch's matmul; "
                        "triton on CPU: the interpreter")
    p.add_argument("--layer-partition", type=partition_arg, default=None,
                   help="layers per pipeline stage, e.g. 3,5; auto: balance the stages' decode cost (the last "
                        "stage also carries the lm_head)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="compute threads of the engine, or of each stage worker on a mesh (default: this "
                        "machine's cores shared among the worker processes)")


SIZE_FLAGS = {  # make-tiny-model flag -> TinyModelSpec field
    "layers": "num_layers", "hidden": "hidden_size", "intermediate": "intermediate_size",
    "moe-intermediate": "moe_intermediate_size", "shared-intermediate": "shared_expert_intermediate_size",
    "heads": "num_heads", "kv-heads": "num_kv_heads", "head-dim": "head_dim", "experts": "num_experts",
    "top-k": "top_k", "vocab": "vocab_size", "max-positions": "max_position_embeddings",
    "decoder-sparse-step": "decoder_sparse_step", "seed": "seed", "max-shard-bytes": "max_shard_bytes"}


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the "
                                                             "checkpoint directory's name)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* "
                                                   "(or set MOEMESH_API_KEY)")
    p.add_argument("--max-pending", type=positive_int, default=1024, help="requests in flight before 429")


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

    g = sub.add_parser("generate", help="generate from prompts (in this process, or on a local mesh with --pp/--tp)")
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

    g.add_argument("--pp", type=positive_int, default=None,
                   help="run on a local mesh: a coordinator and this many pipeline stages as processes")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks per stage (runs on a mesh)")
    g.add_argument("--expert-parallel", action="store_true",
                   help="with --tp: divide each MoE layer's experts among the ranks instead of slicing each")
    g.add_argument("--max-in-flight", type=positive_int, default=None,
                   help="microbatches in the pipeline at once (with --pp; default: pp)")

    c = sub.add_parser("coordinator", help="run the coordinator of a mesh")
    c.add_argument("--model", required=True, help="checkpoint directory (workers read it at the same path)")
    c.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    c.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks per stage")
    c.add_argument("--layer-partition", type=partition_arg, default=None,
                   help="layers per stage, e.g. 3,5; auto: balance the stages' decode cost")
    c.add_argument("--host", default="127.0.0.1", help="address to listen on")
    c.add_argument("--port", type=int, default=5555, help="port for stage workers (0: any free port)")
    c.add_argument("--client-port", type=int, default=5556, help="port for gateways and clients (0: any)")
    c.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    c.add_argument("--block-size", type=positive_int, default=16)
    c.add_argument("--max-batched-tokens", type=positive_int, default=512, help="token budget of one microbatch")
    c.add_argument("--max-seqs", type=positive_int, default=256)
    c.add_argument("--max-in-flight", type=positive_int, default=None, help="microbatches in flight (default: pp)")
    c.add_argument("--worker-timeout", type=float, default=5.0, help="seconds without a heartbeat before a "
                                                                        "worker counts as dead")
    c.add_argument("--expert-parallel", action="store_true",
                   help="divide each MoE layer's experts among a stage's ranks instead of slicing each")
    c.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                   help="fp8: workers quantize the weights to float8 at load (FP8 checkpoints need no flag); "
                        "int8: weight-only int8, per-row scales")
    c.add_argument("--moe-backend", default="auto", choices=list(BACKENDS),
                   help="the workers' kernels (auto: Triton on CUDA, native C kernels on CPU)")
    c.add_argument("--register-timeout", type=float, default=600.0,
                   help="seconds to wait for every stage worker to register before giving up (naming the missing)")

    w = sub.add_parser("stage-worker", help="run one stage worker of a mesh (or one stage alone, --standalone)")
    w.add_argument("--coordinator", default=None, help="the coordinator's worker address, tcp://HOST:PORT")
    w.add_argument("--pp-rank", type=int, default=None)
    w.add_argument("--tp-rank", type=int, default=0)
    w.add_argument("--host", default="127.0.0.1", help="address the activation socket listens on")
    w.add_argument("--advertise-host", default=None, help="address other workers use to reach this one")
    w.add_argument("--port", type=int, default=0, help="activation port (0: any free port)")
    w.add_argument("--kv-memory", type=positive_int, default=1 << 30, help="bytes of KV cache")
    w.add_argument("--threads", type=positive_int, default=None,
                   help="compute threads (default: the cores this process may use)")
    w.add_argument("--device", default="cpu")
    w.add_argument("--record", default=None, metavar="DIR", help="write the first steps' inputs and outputs here")
    w.add_argument("--record-steps", type=positive_int, default=16)
    w.add_argument("--standalone", action="store_true",
                   help="no mesh: run --layers of --model on synthetic input or on a --replay recording")
    w.add_argument("--model", default=None, help="(--standalone) checkpoint directory")
    w.add_argument("--layers", default=None, help="(--standalone) layer range A:B")
    w.add_argument("--replay", default=None, metavar="DIR", help="(--standalone) a directory written by --record")
    w.add_argument("--tokens", type=positive_int, default=64, help="(--standalone) synthetic tokens in the step")
    w.add_argument("--seqs", type=positive_int, default=4, help="(--standalone) synthetic sequences")

    st = sub.add_parser("stage", help="run the tensor-parallel workers of one pipeline stage on this host")
    st.add_argument("--coordinator", required=True, help="the coordinator's worker address, tcp://HOST:PORT")
    st.add_argument("--pp-rank", type=int, required=True)
    st.add_argument("--tp", type=positive_int, default=1, help="workers (tensor ranks) of this stage")
    st.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: worker i on cuda:i")
    st.add_argument("--host", default="0.0.0.0", help="address the activation sockets listen on")
    st.add_argument("--advertise-host", default=None, help="address other hosts use to reach this one")
    st.add_argument("--kv-memory", type=positive_int, default=1 << 30, help="bytes of KV cache per worker")
    st.add_argument("--threads", type=positive_int, default=None,
                    help="compute threads per worker (default: this host's cores shared among the --tp workers)")

    q = sub.add_parser("quantize", help="write an FP8 copy of a checkpoint (AutoFP8's layout)")
    q.add_argument("--model", required=True, help="checkpoint directory (16/32-bit)")
    q.add_argument("--out", required=True, type=Path, help="where to write the FP8 checkpoint")

    gw = sub.add_parser("gateway", help="run an OpenAI-compatible HTTP gateway in front of a coordinator")
    gw.add_argument("--coordinator", required=True, help="the coordinator's client address, tcp://HOST:PORT")
    add_http_args(gw)
    gw.add_argument("--model", default=None, help="checkpoint directory for the tokenizer (default: the "
                                                  "coordinator's, at the same path)")

    sv = sub.add_parser("serve", help="start coordinator, stage workers and gateway on this machine")
    add_engine_args(sv)
    add_http_args(sv)
    sv.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    sv.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks per stage")
    sv.add_argument("--expert-parallel", action="store_true")
    sv.add_argument("--max-in-flight", type=positive_int, default=None)
    sv.add_argument("--launcher", default="local", choices=["local", "ray"],
                    help="start the stage workers as local processes, or as Ray actors (a placement group per "
                         "stage)")
    sv.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start one here)")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    m = bsub.add_parser("model", help="decode throughput of the in-process engine vs transformers and the roofline")
    m.add_argument("--model", required=True)
    m.add_argument("--batch", type=int_list, default=[1, 8, 32, 64])
    m.add_argument("--new", type=positive_int, default=64, help="tokens generated per sequence")
    m.add_argument("--prompt-len", type=positive_int, default=32)
    m.add_argument("--threads", type=positive_int, default=1)
    m.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    m.add_argument("--quantization", default=None, choices=["fp8", "int8"])
    m.add_argument("--moe-backend", type=backend_list, default=["auto"],
                   help="kernels to measure, one engine each in this run, e.g. native,torch (the first is "
                        "compared with the others)")
    m.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    m.add_argument("--json", action="store_true", help="one JSON line per (impl, batch)")
    tb = bsub.add_parser("throughput", help="offline throughput of the mesh per layout, vs the in-process engine")
    tb.add_argument("--model", required=True)
    tb.add_argument("--pp", type=int_list, default=[1, 2], help="pipeline stages of each layout, e.g. 1,2")
    tb.add_argument("--tp", type=int_list, default=[1], help="tensor-parallel ranks of each layout, e.g. 1,2")
    tb.add_argument("--expert-parallel", action="store_true")
    tb.add_argument("--layer-partition", type=partition_arg, default=None,
                    help="auto: balanced stages for every --pp; or layers per stage for the layout with that many")
    tb.add_argument("--concurrency", type=positive_int, default=64, help="requests in flight at once")
    tb.add_argument("--num-prompts", type=positive_int, default=None, help="(default: --concurrency)")
    tb.add_argument("--prompt-len", type=positive_int, default=32)
    tb.add_argument("--new", type=positive_int, default=64, help="tokens generated per request")
    tb.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    tb.add_argument("--kv-memory", type=positive_int, default=256 << 20, help="KV-cache bytes per worker")
    tb.add_argument("--max-batched-tokens", type=positive_int, default=2048)
    tb.add_argument("--no-baseline", action="store_true", help="skip the in-process engine")
    tb.add_argument("--netns", action="store_true", help="run each layout across simulated hosts (network "
                                                         "namespaces; needs root): coordinator and each stage apart")
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
    fb.add_argument("--threads", type=positive_int, default=1)
    fb.add_argument("--json", action="store_true")

    sb = bsub.add_parser("serve", help="latency and throughput of a running server over HTTP")
    sb.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    sb.add_argument("--concurrency", type=int_list, default=[64], help="requests in flight; a list gives a curve")
    sb.add_argument("--num-prompts", type=positive_int, default=200)
    sb.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all "
                                                                     "at once)")
    sb.add_argument("--prompt-len", type=positive_int, default=32,
                    help="prompt tokens of each request (after the shared prefix, if any)")
    sb.add_argument("--shared-prefix", type=int, default=0, metavar="P",
                    help="every prompt starts with the same P random tokens (the prefix-caching workload)")
    sb.add_argument("--model-name", default=None, help="the request's \"model\" field (some servers want one)")
    sb.add_argument("--new", type=positive_int, default=64)
    sb.add_argument("--vocab", type=positive_int, default=1000, help="prompt token ids are drawn below this")
    sb.add_argument("--seed", type=int, default=0)
    sb.add_argument("--api-key", default=None)
    sb.add_argument("--json", action="store_true", help="one JSON line per concurrency level")
    sb.add_argument("--plot", default=None, help="write a latency-vs-throughput plot (PNG)")
    for command in (parser, c, w, st, gw, sv):
        defaults_from_env(command)
    return parser


def defaults_from_env(parser: argparse.ArgumentParser, environ=None) -> None:
    """Every --flag of the process commands can come from MOEMESH_FLAG (dashes as underscores), as
    containers configure them; a flag on the command line still wins. A bad value names both."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags or action.dest == "help":
            continue
        var = "MOEMESH_" + flags[0][2:].upper().replace("-", "_")
        if var not in environ:
            continue
        raw = environ[var]
        if isinstance(action, argparse._StoreTrueAction):
            value = raw.lower() in ("1", "true", "yes", "on")
        else:
            try:
                value = action.type(raw) if action.type else raw
            except (TypeError, ValueError):
                parser.error(f"{var}={raw!r} is not a valid value for {flags[0]}")
            if action.choices and value not in action.choices:
                parser.error(f"{var}={raw!r} is not one of {', '.join(map(str, action.choices))} ({flags[0]})")
        action.default = value
        action.required = False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "moe_backend", None) == "triton" and getattr(args, "device", "cpu") == "cpu":
        # Triton kernels run on CPU tensors only in its interpreter, chosen when they are defined;
        # child processes (the mesh) inherit it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from moemesh.log import setup_logging

    setup_logging(args.log_level)
    try:
        if args.command == "make-tiny-model":
            return cmd_make_tiny_model(args)
        if args.command == "generate":
            from moemesh.generate import run_generate

            return run_generate(args)
        if args.command == "gateway":
            return cmd_gateway(args)
        if args.command == "stage":
            return cmd_stage(args)
        if args.command == "quantize":
            from moemesh.quantize import quantize_checkpoint

            print(quantize_checkpoint(args.model, args.out))
            return 0
        if args.command == "serve":
            from moemesh.serve import run_serve

            return run_serve(args)
        if args.command == "coordinator":
            return cmd_coordinator(args)
        if args.command == "stage-worker":
            return cmd_stage_worker(args)
        if args.command == "bench" and args.bench == "fp8":
            from moemesh.bench.fp8 import run_fp8_bench

            return run_fp8_bench(args)
        if args.command == "bench" and args.bench == "serve":
            from moemesh.bench.serve import run_serve_bench

            return run_serve_bench(args)
        if args.command == "bench" and args.bench == "throughput":
            from moemesh.bench.throughput import run_throughput_bench

            return run_throughput_bench(args)
        if args.command == "bench" and args.bench == "model":
            from moemesh.bench.model import run_model_bench

            return run_model_bench(args)
    except (CLIError, ConfigError, LoadError) as e:
        parser.exit(2, f"moemesh: error: {e}\n")
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_coordinator(args) -> int:
    from coordinator.server import Coordinator, CoordinatorConfig
    from moemesh.netutil import run

    try:
        coord = Coordinator(CoordinatorConfig(
            model=args.model, pp=args.pp, tp=args.tp,
            layer_partition=resolve_partition(args.layer_partition, args.model, args.pp),
            host=args.host, port=args.port, client_port=args.client_port, dtype=args.dtype,
            block_size=args.block_size, max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_seqs,
            max_in_flight=args.max_in_flight, worker_timeout=args.worker_timeout,
            expert_parallel=args.expert_parallel, register_timeout=args.register_timeout,
            quantization=args.quantization, moe_backend=args.moe_backend))
    except ValueError as e:
        raise CLIError(str(e)) from None
    run(coord.run())
    return 0


def cmd_stage(args) -> int:
    from moemesh.launcher import run_stage

    from moemesh.launcher import threads_per_worker

    common = ["--coordinator", args.coordinator, "--host", args.host, "--kv-memory", str(args.kv_memory),
              "--threads", str(threads_per_worker(args, args.tp))]
    if args.advertise_host:
        common += ["--advertise-host", args.advertise_host]
    return run_stage(common, args.pp_rank, args.tp, args.device)  # activation ports: any free ones


def cmd_gateway(args) -> int:
    from gateway.server import GatewayConfig, run_gateway
    from moemesh.netutil import run

    run(run_gateway(GatewayConfig(coordinator=args.coordinator, host=args.host, port=args.port, model=args.model,
                                  served_model_name=args.served_model_name, api_key=args.api_key,
                                  max_pending=args.max_pending)))
    return 0


def cmd_stage_worker(args) -> int:
    from moemesh.launcher import threads_per_worker
    from moemesh.netutil import run
    from stage_worker.worker import StageWorker, WorkerConfig

    if args.standalone:
        return cmd_standalone(args)
    if args.coordinator is None or args.pp_rank is None:
        raise CLIError("stage-worker needs --coordinator and --pp-rank (or --standalone)")
    return run(StageWorker(WorkerConfig(
        coordinator=args.coordinator, pp_rank=args.pp_rank, tp_rank=args.tp_rank, bind_host=args.host,
        advertise_host=args.advertise_host, port=args.port, kv_memory_bytes=args.kv_memory, device=args.device,
        threads=threads_per_worker(args, 1), record_dir=args.record, record_steps=args.record_steps)).run())


def cmd_standalone(args) -> int:
    import torch

    from moemesh.config import ModelConfig
    from stage_worker.standalone import run_standalone

    if args.model is None or args.layers is None:
        raise CLIError("--standalone needs --model DIR and --layers A:B")
    try:
        a, b = (int(x) for x in args.layers.split(":"))
    except ValueError:
        raise CLIError(f"--layers {args.layers!r}: expected A:B, e.g. 0:4") from None
    n = ModelConfig.from_dir(args.model).num_layers
    if not 0 <= a < b <= n:
        raise CLIError(f"--layers {a}:{b} is outside the model's 0:{n}")
    if args.tp_rank:
        raise CLIError("--standalone runs one process: tensor parallelism needs the mesh (leave --tp-rank out)")
    from moemesh.launcher import threads_per_worker

    torch.set_num_threads(threads_per_worker(args, 1))
    try:
        return run_standalone(args.model, range(a, b), args.replay, args.tokens, args.seqs)
    except FileNotFoundError as e:
        raise CLIError(f"--replay: {e}") from None


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

