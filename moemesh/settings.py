"""Every setting of every process, each declared once: its flag, type, default, help and `MOEMESH_*`
variable all come from one dataclass field.

    class WorkerSettings(WorkerResources, MeshSecurity):
        coordinator: str | None = flag(None, "the coordinator's worker address, tcp://HOST:PORT", parse=tcp_address)
        ...

A settings class builds its argparse flags (`add_arguments`, defaults from `MOEMESH_<FLAG>` where
set), is built back from the parsed flags (`from_args`), and renders itself into argv (`to_argv`) or
environment variables (`to_env`) for a child process: the local launcher, `moemesh stage`, the Ray
launcher and the namespace benchmark start every child that way, so a field added here reaches the
command line, the environment, the compose files and every child with no other edit.

The classes, one per process role, share groups of fields by inheritance:

    ModelSettings      model, dtype, quantization, moe_backend      what a stage computes
    LayoutSettings     pp, tp, layer_partition, expert_parallel,     how the model is split
                       no_mlp_handoff
    SchedulerSettings  block_size, max_batched_tokens, max_seqs, max_in_flight, num_scheduler_steps,
                       num_speculative_tokens (and its n-gram lookup)
    WorkerResources    kv_memory, threads, device, ...               what each stage worker may use
    PipelineTimeouts   worker, register, ready, step, recovery       the coordinator's deadlines
    MeshSecurity       mesh_keys, insecure_mesh                      CurveZMQ on the mesh (every mesh process)
    CoordinatorSettings = Model + Layout + Scheduler + PipelineTimeouts + its sockets
    WorkerSettings      = WorkerResources + its coordinator, ranks, sockets, recording
    StageSettings       = WorkerSettings + tp (`moemesh stage` starts tp workers)
    GatewaySettings       the HTTP front: coordinator, host, port, model, names, keys, limits
    EngineSettings      = Model + Layout + Scheduler + WorkerResources + PipelineTimeouts
                          (generate, serve, LLMEngine)
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from moemesh.config import DTYPES, MOE_BACKENDS, QUANTIZATIONS
from moemesh.protocol import MAX_KV_BLOCKS


# -- flag types ---------------------------------------------------------------------------------

def host_memory() -> int:
    """This host's physical memory in bytes (what a KV cache on the CPU can be at most)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


MAX_COUNT = 1 << 40  # the most a count, size or byte flag takes (_int_at_least)


def _int_at_least(low: int, name: str, high: int = MAX_COUNT):
    """An integer flag's parser, refusing values below `low` or above `high` (by default 2^40: no count,
    size or byte figure of a host comes near it, and a larger one would overflow a C integer in ZeroMQ
    or torch before anything said which flag it was); `name` is what argparse's errors say."""
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError
        return value

    parse.__name__ = name
    return parse


positive_int = _int_at_least(1, "positive integer (up to 2^40)")
non_negative_int = _int_at_least(0, "non-negative integer (up to 2^40)")
# (OpenMP cannot start many thousands of threads: a process would die without a word at its first
# parallel operation)
threads_int = _int_at_least(1, "thread count (1 to 1024)", high=1024)
byte_count = _int_at_least(1, "byte count (up to 2^60)", high=1 << 60)
seed_int = _int_at_least(0, "seed (0 to 2^63 - 1)", high=(1 << 63) - 1)


port_int = _int_at_least(0, "port (0 to 65535)", high=65535)


def device_arg(text: str) -> str:
    """cpu, cuda or cuda:N (what torch takes), checked before anything registers with it."""
    if text in ("cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ValueError(text)


device_arg.__name__ = "device (cpu, cuda or cuda:N)"


def tcp_address(text: str) -> str:
    """tcp://HOST:PORT with a port a peer can listen on (1 to 65535)."""
    host, sep, port = text.removeprefix("tcp://").rpartition(":") if text.startswith("tcp://") else ("", "", "")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(text)
    if host.startswith("[") or host.endswith("]"):  # an IPv6 address, bracketed
        try:
            ipaddress.IPv6Address(host.removeprefix("[").removesuffix("]"))
        except ValueError:
            raise ValueError(text) from None
        if not (host.startswith("[") and host.endswith("]")):
            raise ValueError(text)
    elif not all(c.isalnum() or c in "-._*" for c in host):  # a name or an IPv4 address (* : any interface)
        raise ValueError(text)
    return text


tcp_address.__name__ = "address (tcp://HOST:PORT)"


def positive_int_list(text: str) -> list[int]:
    values = int_list(text)
    if not values or min(values) < 1:
        raise ValueError(text)
    return values


positive_int_list.__name__ = "comma-separated list of positive integers"


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


int_list.__name__ = "comma-separated list of integers"


def partition_arg(text: str):
    """--layer-partition: "auto", "auto:PROMPT:OUTPUT" (the workload's token mix) or layers per stage, e.g. 3,5."""
    text = text.strip()
    if text == "auto" or text.startswith("auto:"):
        auto_mix(text)  # (refuses a malformed mix)
        return text
    counts = tuple(int_list(text))
    if not counts:  # ("" or ","; a count below 1 is named with the model's layers, where they are known)
        raise ValueError(text)
    return counts


partition_arg.__name__ = "auto, auto:PROMPT:OUTPUT or a comma-separated list of integers"


def auto_mix(text: str) -> tuple[int, int]:
    """"auto" -> (1, 1); "auto:P:O" -> (P, O): prompt and output tokens of a typical request."""
    if text == "auto":
        return 1, 1
    parts = text.split(":")
    if len(parts) != 3 or parts[0] != "auto":
        raise ValueError(text)
    prompt, output = int(parts[1]), int(parts[2])
    if prompt < 0 or output < 1:
        raise ValueError(text)
    return prompt, output


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError
    return value


positive_float.__name__ = "positive finite number"


def json_object(text: str) -> str:
    """A flag that holds a JSON object, kept as its compact text (what a child's flags render back)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError
    return json.dumps(value, separators=(",", ":"))


json_object.__name__ = "JSON object"


# -- declaring ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Flag:
    help: str
    parse: Callable[[str], Any] | None = None  # text -> value; None: the text itself
    choices: tuple | None = None
    metavar: str | None = None


def flag(default, help: str, *, parse=None, choices=None, metavar=None):
    """A settings field that is also a command-line flag (--field-name) and MOEMESH_FIELD_NAME."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, parse, choices, metavar)})


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "MOEMESH_" + name.upper()


def render(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


@dataclass(frozen=True)
class Settings:
    @classmethod
    def flags(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, environ=None, **overrides) -> None:
        """Adds a flag per field. `overrides[field]` changes its default, help, choices or required-ness
        for this command (a dict), or leaves it out (None). `MOEMESH_<FIELD>` in the environment sets
        the default (a flag on the command line still wins); a bad value names both."""
        environ = os.environ if environ is None else environ
        for f in cls.flags():
            change = overrides.get(f.name, {})
            if change is None:
                continue
            spec: Flag = f.metadata["flag"]
            if "choices" in change:
                spec = dataclasses.replace(spec, choices=tuple(change["choices"]))
            default, required = change.get("default", f.default), change.get("required", False)
            var = env_name(f.name)
            if var in environ:
                default, required = _from_env(var, environ[var]), False
            kwargs = dict(dest=f.name, default=default, help=change.get("help", spec.help))
            if f.type in (bool, "bool"):  # --flag, or --flag=false to turn off what a MOEMESH_* variable set
                # (argparse converts a string default, a variable's, with the type too)
                parser.add_argument(option_name(f.name), nargs="?", const=True, type=_flag_bool,
                                    metavar="true|false", **kwargs)
                continue
            if isinstance(default, _EnvText):  # parsed by argparse only if this command runs without the flag
                kwargs["type"] = _env_checked(spec)
            elif spec.parse is not None:
                kwargs["type"] = spec.parse
            if spec.choices is not None:
                kwargs["choices"] = list(spec.choices)
            if spec.metavar:
                kwargs["metavar"] = spec.metavar
            parser.add_argument(option_name(f.name), required=required, **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes):
        """The settings in a parsed namespace (fields the command left out keep their defaults)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **changes})

    @classmethod
    def from_argv(cls, argv: list[str], environ=None):
        parser = argparse.ArgumentParser(prog=cls.__name__)
        cls.add_arguments(parser, environ={} if environ is None else environ)
        return cls.from_args(parser.parse_args(argv))

    @classmethod
    def derive(cls, *sources, **changes):
        """Settings of this class from others' same-named fields (later sources win), then `changes`."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for source in sources:
            values.update({f.name: getattr(source, f.name) for f in dataclasses.fields(source) if f.name in names})
        unknown = set(changes) - names
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
        return cls(**{**values, **changes})

    def to_argv(self) -> list[str]:
        """Flags that rebuild these settings in a child (a flag for every field not None or False)."""
        argv = []
        for f in self.flags():
            value = getattr(self, f.name)
            if value is None or value is False:
                continue
            # (one item, --flag=value: a value that starts with "-" is not taken for a flag)
            argv.append(option_name(f.name) if value is True else f"{option_name(f.name)}={render(value)}")
        return argv

    def to_env(self) -> dict[str, str]:
        """The same as MOEMESH_* variables (a container's way)."""
        env = {}
        for f in self.flags():
            value = getattr(self, f.name)
            if value is not None and value is not False:
                env[env_name(f.name)] = "1" if value is True else render(value)
        return env


class _EnvText(str):
    """A MOEMESH_* value as a flag's default. argparse parses a string default only when the command it
    belongs to runs without the flag, so a bad value stops that command alone, and says where it came
    from (`_env_checked`), not every command that merely has the flag."""
    var = ""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _from_env(var: str, raw: str) -> _EnvText:
    text = _EnvText(raw.strip())  # (a value a compose file or a shell quoted with its spaces)
    text.var = var
    return text


def _env_bool(text: _EnvText) -> bool:
    """A boolean flag's MOEMESH_* value (argparse names the flag with the error)."""
    if text.lower() not in _TRUE + _FALSE:
        raise argparse.ArgumentTypeError(f"{text.var}={str(text)!r} is not 1/0, true/false, yes/no or on/off")
    return text.lower() in _TRUE


def _flag_bool(text: str) -> bool:
    """A boolean flag's value: --flag=false, or its MOEMESH_* variable's."""
    if isinstance(text, _EnvText):
        return _env_bool(text)
    if text.lower() not in _TRUE + _FALSE:
        raise argparse.ArgumentTypeError(f"{text!r} is not 1/0, true/false, yes/no or on/off")
    return text.lower() in _TRUE


def _env_checked(spec: Flag):
    """The flag's parser, for a flag whose default came from the environment: a bad value of the
    variable names it (argparse adds the flag; it checks the choices of a value given as a flag itself)."""
    def parse(text: str):
        if not isinstance(text, _EnvText):
            return spec.parse(text) if spec.parse else text
        try:
            value = spec.parse(text) if spec.parse else str(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text.var}={str(text)!r} is not a valid value") from None
        if spec.choices and value not in spec.choices:
            raise argparse.ArgumentTypeError(f"{text.var}={str(text)!r} is not one of "
                                             f"{', '.join(map(str, spec.choices))}")
        return value

    parse.__name__ = getattr(spec.parse, "__name__", "value")
    return parse


# -- the settings -------------------------------------------------------------------------------

@dataclass(frozen=True)
class LogSettings(Settings):
    log_level: str = flag("warning", "what the processes log", parse=str.lower,
                          choices=("debug", "info", "warning", "error"))
    log_format: str = flag("text", "how each log line reads: text (key=value pairs) or json (one JSON object a "
                                   "line, for a log shipper)", parse=str.lower, choices=("text", "json"))


@dataclass(frozen=True)
class LaunchSettings(Settings):
    """How `moemesh serve` starts its stage workers."""
    launcher: str = flag("local", "start the stage workers as local processes, or as Ray actors (a placement "
                                  "group per stage)", choices=("local", "ray"))
    ray_address: str | None = flag(None, "an existing Ray cluster (default: start one here)")


@dataclass(frozen=True)
class StandaloneSettings(Settings):
    """`moemesh stage-worker --standalone`: one stage's layers in one process, no mesh."""
    standalone: bool = flag(False, "no mesh: run --layers of --model on synthetic input or on a --replay recording")
    model: str | None = flag(None, "(--standalone) checkpoint directory")
    layers: str | None = flag(None, "(--standalone) layer range A:B")
    replay: str | None = flag(None, "(--standalone) a directory written by --record", metavar="DIR")
    tokens: int = flag(64, "(--standalone) synthetic tokens in the step", parse=positive_int)
    seqs: int = flag(4, "(--standalone) synthetic sequences", parse=positive_int)
    dtype: str | None = flag(None, "(--standalone) compute dtype (default: the recording's, else auto)",
                             choices=("auto", *DTYPES))
    quantization: str | None = flag(None, "(--standalone) fp8 or int8 weights (default: the recording's; an FP8 "
                                          "checkpoint is always run as one)", choices=QUANTIZATIONS)
    moe_backend: str | None = flag(None, "(--standalone) the kernels (default: the recording's, else auto)",
                                   choices=MOE_BACKENDS)


@dataclass(frozen=True)
class MeshSecurity(Settings):
    """CurveZMQ on the mesh (moemesh/mesh_security.py); every process of a mesh takes the same two."""
    mesh_keys: str | None = flag(None, "the mesh's CurveZMQ keys (`moemesh keys --out DIR`): every mesh socket "
                                       "authenticated and encrypted, only peers with an allowed key let in",
                                 metavar="DIR")
    insecure_mesh: bool = flag(False, "let mesh sockets listen on or connect to addresses beyond loopback without "
                                      "--mesh-keys (anyone who reaches them can use the model and inject "
                                      "activations: only on a network protected another way)")


@dataclass(frozen=True)
class ModelSettings(Settings):
    model: str | None = flag(None, "checkpoint directory (default: the built-in trained demo model)")
    dtype: str = flag("auto", "auto: float32 on CPU, the checkpoint's dtype on GPU", choices=("auto", *DTYPES))
    quantization: str | None = flag(
        None, "fp8: quantize the weights to float8 at load (FP8 checkpoints need no flag); int8: weight-only "
              "int8 with per-row scales (fast with the native CPU kernels)", choices=QUANTIZATIONS)
    moe_backend: str = flag(
        "auto", "the kernels: auto = Triton on CUDA, native C kernels on CPU (torch where no C compiler); "
                "native: packed-weight CPU kernels for experts and linear layers; torch: torch's matmul; "
                "triton on CPU: the interpreter", choices=MOE_BACKENDS)


@dataclass(frozen=True)
class LayoutSettings(Settings):
    pp: int = flag(1, "pipeline stages", parse=positive_int)
    tp: int = flag(1, "tensor-parallel ranks per stage", parse=positive_int)
    layer_partition: tuple[int, ...] | str | None = flag(
        None, "layers per pipeline stage, e.g. 3,5; auto: balance the stages' cost per token (the last stage also "
              "carries the lm_head, which only sampled tokens pay) for requests of as many prompt as output tokens; "
              "auto:PROMPT:OUTPUT for another mix, e.g. auto:32:64", parse=partition_arg)
    partition_costs: str = flag(
        "measured", "what --layer-partition auto balances: measured (decode steps of stages of one and two layers "
                    "and of the last stage, and a prompt chunk, timed on this CPU with the stages' kernels once and "
                    "kept in ~/.cache/moemesh/costs; the weights' where stages run on a GPU, layers are too large "
                    "to time, or on a standalone coordinator) or weights (multiply-adds of the weights each token "
                    "uses)", choices=("measured", "weights"))
    expert_parallel: bool = flag(False, "with --tp: divide each MoE layer's experts among a stage's ranks "
                                        "instead of slicing each")
    no_mlp_handoff: bool = flag(False, "with --pp: no MLP hand-off (by default a stage after a heavier one also "
                                       "holds that stage's last MLP and runs it for steps with prompt chunks where "
                                       "that evens the stages, at the cost of one MLP's weights on it)")


@dataclass(frozen=True)
class SchedulerSettings(Settings):
    block_size: int = flag(16, "tokens per KV-cache block", parse=positive_int)
    max_batched_tokens: int = flag(512, "token budget of one step (one microbatch)", parse=positive_int)
    max_seqs: int = flag(256, "sequences in one step at most", parse=positive_int)
    max_in_flight: int | None = flag(None, "microbatches in the pipeline at once (default: pp)", parse=positive_int)
    no_prefix_caching: bool = flag(False, "recompute every prompt from scratch instead of reusing the KV blocks "
                                          "of a prefix seen before")
    max_waiting: int = flag(4096, "requests waiting to be scheduled (every client's) before new ones are refused "
                                  "with 429", parse=positive_int)
    max_model_len: int | None = flag(None, "the longest context (prompt plus output) a request may have "
                                           "(default: the model's max_position_embeddings; more is refused; "
                                           "either is lowered to what the KV cache holds)", parse=positive_int)
    num_scheduler_steps: int = flag(1, "decode steps one schedule runs when every running sequence decodes and "
                                       "none waits (vLLM's multi-step scheduling; --pp, --tp and --max-in-flight "
                                       "1): the worker feeds each sampled token back itself, and tokens stream in "
                                       "bursts of up to this many", parse=positive_int)
    num_speculative_tokens: int = flag(0, "speculative decoding by prompt lookup: draft tokens a greedy request's "
                                          "decode may carry, copied from where its last tokens occurred before in "
                                          "its prompt or output; the last stage keeps those its argmax agrees "
                                          "with, so repetitive text takes fewer steps to the same output (in "
                                          "float32; in bfloat16 or int8 a step's extra rows can tip a near-tie, "
                                          "as a larger batch can) (0: off)", parse=non_negative_int)
    speculative_config: str | None = flag(
        None, "vLLM's form of the flags above, a JSON object: {\"method\": \"ngram\", \"num_speculative_tokens\": K, "
              "\"prompt_lookup_max\": N, \"prompt_lookup_min\": M, \"disable_by_batch_size\": B} (only the ngram "
              "method: no draft models, EAGLE or MTP)", parse=json_object, metavar="JSON")
    speculative_sampling: bool = flag(False, "with --num-speculative-tokens: drafts for requests that sample without "
                                             "a seed too, kept by speculative sampling (each token distributed as "
                                             "without drafts); off by default: the demo model at temperature 0.7 "
                                             "kept a fifth to a third of them and lost 2-13%%")
    ngram_prompt_lookup_max: int = flag(4, "with --num-speculative-tokens: the longest run of last tokens looked "
                                           "up (tried first)", parse=positive_int)
    ngram_prompt_lookup_min: int = flag(2, "with --num-speculative-tokens: the shortest run of last tokens "
                                           "looked up", parse=positive_int)
    speculative_disable_by_batch_size: int = flag(
        4, "with --num-speculative-tokens: no draft tokens while more than this many requests run (a larger "
           "batch has less idle bandwidth to check guesses with: on this project's CPU drafts paid up to 4 "
           "sequences and lost from 16, docs/benchmarks.md)", parse=positive_int)


@dataclass(frozen=True)
class WorkerResources(Settings):
    kv_memory: int = flag(1 << 30, "bytes of KV cache (default 1 GiB): per stage worker on a mesh, for all "
                                   "layers in one process", parse=byte_count)
    threads: int | None = flag(None, "compute threads of the engine, or of each stage worker on a mesh "
                                     "(default: this machine's cores shared among the worker processes)",
                               parse=threads_int)
    num_kv_blocks: int | None = flag(None, "a KV pool of exactly this many blocks instead of one sized from "
                                           "--kv-memory", parse=positive_int)
    device: str = flag("cpu", "cpu, cuda or cuda:N; a mesh started here puts its worker i (stage by stage, "
                              "tensor rank by rank) on cuda:i for cuda", parse=device_arg)
    coordinator_timeout: float = flag(10.0, "seconds a stage worker waits without a word from the coordinator "
                                            "(once it has spoken) before it exits, to be started again and "
                                            "register with the coordinator that answers", parse=positive_float)
    no_huge_pages: bool = flag(False, "keep the packed CPU weights on the allocator's 4 KiB pages instead of "
                                      "asking for 2 MiB ones (decode at few rows is a few percent slower; on a "
                                      "host that must fault huge pages in again, loading can be faster)")

    def kv_blocks(self, bytes_per_block: int) -> int:
        """The KV sizing rule, the same for a stage worker (its layers) and the in-process engine (all
        layers, one pool): the blocks that kv_memory holds, at least one."""
        return min(MAX_KV_BLOCKS, self.num_kv_blocks or max(1, self.kv_memory // bytes_per_block))


@dataclass(frozen=True)
class PipelineTimeouts(Settings):
    """The coordinator's, and `serve`'s and `generate`'s for the coordinator they start."""
    worker_timeout: float = flag(5.0, "seconds without a heartbeat before a worker counts as dead",
                                 parse=positive_float)
    register_timeout: float = flag(600.0, "seconds to wait for every stage worker to register before giving up "
                                          "(naming the missing)", parse=positive_float)
    ready_timeout: float = flag(1800.0, "seconds to wait for the registered workers to load their layers and "
                                        "report ready", parse=positive_float)
    step_timeout: float = flag(120.0, "seconds a step may stay in flight before the pipeline is reset (every step "
                                      "in flight recomputed); if that does not help, the stage behind it is replaced",
                               parse=positive_float)
    recovery_timeout: float = flag(120.0, "seconds a recovering pipeline waits for a replacement of a lost worker "
                                          "(and its load) before it ends every request with 503", parse=positive_float)


@dataclass(frozen=True)
class EngineSettings(ModelSettings, LayoutSettings, SchedulerSettings, WorkerResources, PipelineTimeouts,
                     MeshSecurity):
    """The whole system on this machine: `generate`, `serve`, `LLMEngine`, `LocalMesh.of`."""


@dataclass(frozen=True)
class CoordinatorSettings(ModelSettings, LayoutSettings, SchedulerSettings, PipelineTimeouts, MeshSecurity):
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(0, "port for stage workers (0: any free port)", parse=port_int)
    client_port: int = flag(0, "port for gateways and clients (0: any free port)", parse=port_int)
    drain_timeout: float = flag(6.0, "seconds a stop (SIGTERM) lets the requests in flight finish, refusing new "
                                     "ones (503), before the coordinator and its workers end (a mesh serve starts "
                                     "drains at its gateway instead)", parse=positive_float)


@dataclass(frozen=True)
class WorkerSettings(WorkerResources, MeshSecurity):
    coordinator: str | None = flag(None, "the coordinator's worker address, tcp://HOST:PORT", parse=tcp_address)
    pp_rank: int | None = flag(None, "this worker's pipeline stage", parse=non_negative_int)
    tp_rank: int = flag(0, "this worker's tensor rank in its stage", parse=non_negative_int)
    host: str = flag("127.0.0.1", "address the activation socket listens on")
    advertise_host: str | None = flag(None, "address other workers use to reach this one (default: --host; for "
                                            "0.0.0.0, this host's address on the route to --coordinator)")
    port: int = flag(0, "activation port (0: any free port)", parse=port_int)
    record: str | None = flag(None, "write the first steps' inputs and outputs here", metavar="DIR")
    record_steps: int = flag(16, "steps --record writes", parse=positive_int)
    max_message_bytes: int = flag(1 << 30, "the largest message this worker accepts (a schedule, the previous "
                                             "stage's activations; a peer that sends more is cut off); serve and "
                                             "generate derive it from the model and --max-batched-tokens",
                                  parse=positive_int)
    max_activation_bytes: int = flag(0, "the largest activations message this worker accepts from the previous "
                                        "stage (0: --max-message-bytes); serve and generate derive it from the "
                                        "model's hidden size and --max-batched-tokens", parse=non_negative_int)
    heartbeat_interval: float = 0.5


@dataclass(frozen=True)
class StageSettings(WorkerSettings):
    """`moemesh stage`: the --tp workers of one pipeline stage on one host (worker i gets tp rank i)."""
    tp: int = flag(1, "workers (tensor ranks) of this stage", parse=positive_int)


@dataclass(frozen=True)
class GatewaySettings(MeshSecurity):
    coordinator: str | None = flag(None, "the coordinator's client address, tcp://HOST:PORT", parse=tcp_address)
    host: str = flag("127.0.0.1", "HTTP address to listen on")
    port: int = flag(8000, "HTTP port", parse=port_int)
    model: str | None = flag(None, "checkpoint directory for the tokenizer (default: the coordinator's, at the "
                                   "same path)")
    served_model_name: str | None = flag(None, "the model name clients use (default: the checkpoint "
                                               "directory's name)")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on "
                                     "/v1/* (or set MOEMESH_API_KEY)")
    api_key_file: str | None = flag(None, "accept any of the API keys in this file (one a line; # comments), with "
                                          "--api-key's", metavar="FILE")
    ssl_certfile: str | None = flag(None, "serve HTTPS with this certificate chain (PEM)", metavar="FILE")
    ssl_keyfile: str | None = flag(None, "the private key of --ssl-certfile (PEM), if not in that file",
                                   metavar="FILE")
    max_stored_responses: int = flag(1024, "responses (POST /v1/responses with store true, OpenAI's default) kept in "
                                           "this gateway's memory for GET /v1/responses/ID and previous_response_id: "
                                           "the newest this many, holding at most 64 Mi characters of JSON (0: none)",
                                     parse=non_negative_int)
    max_pending: int = flag(1024, "requests in flight before 429", parse=positive_int)
    generation_config: str = flag(
        "auto", "auto: requests that do not set temperature, top_p, top_k, min_p or repetition_penalty get the "
                "model's generation_config.json values, and its max_new_tokens caps max_tokens (as in vLLM); "
                "vllm: the OpenAI defaults",
        choices=("auto", "vllm"))
    tool_call_parser: str | None = flag(
        None, "read the model's tool calls from its text, which tool_choice auto (the default with tools) needs: "
              "hermes (<tool_call> JSON blocks: Qwen2.5, Qwen3, Hermes), qwen3_coder (<tool_call><function=...> "
              "blocks: Qwen3-Coder), mistral ([TOOL_CALLS] and a JSON list: Mixtral-8x22B, Mistral), llama3_json "
              "(JSON objects: Llama 3.1-3.3), pythonic ([f(x=1)]: Llama 3.2, 4)",
        choices=("hermes", "qwen3_coder", "mistral", "llama3_json", "pythonic"))  # (gateway/tools.py's PARSERS)
    reasoning_parser: str | None = flag(
        None, "return a thinking model's thought (<think> ... </think>) apart from its answer, in the chat "
              "message's reasoning and reasoning_content: qwen3 (an answer that opens with <think>; Qwen3), "
              "deepseek_r1 (the answer up to </think>; DeepSeek-R1, QwQ)",
        choices=("deepseek_r1", "qwen3"))  # (gateway/reasoning.py's PARSERS)
    stream_timeout: float = flag(30.0, "seconds a streaming client may leave an event unread (its connection's "
                                       "buffers full) before its request is aborted and its KV blocks freed, "
                                       "and a client may pause in sending its request body (which must also arrive "
                                       "whole within 4 times this: else a 408)",
                                 parse=positive_float)
    keepalive_timeout: float = flag(75.0, "seconds a client's connection may stay idle between requests before the "
                                          "gateway closes it; a request's headers must also arrive whole within "
                                          "this (from the connection's start or the previous reply's end)",
                                    parse=positive_float)
    drain_timeout: float = flag(5.0, "seconds a stop (SIGTERM, Ctrl-C) lets the requests in flight finish after "
                                     "the gateway stops listening; those still open then end with a 503 (an "
                                     "error event and [DONE] in a stream), within 2 s more", parse=positive_float)
    max_body_bytes: int = 8 << 20
