"""`moemesh generate`: run prompts through the in-process engine and print the results."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch

from coordinator.step_loop import check_num_steps
from moemesh.config import ModelConfig
from moemesh.entrypoints.engine import LLMEngine, Output
from moemesh.entrypoints.launcher import threads_per_worker
from moemesh.errors import CLIError, ConfigError
from moemesh.layout import resolve_layout
from moemesh.log import get_logger
from moemesh.netutil import run
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings
from moemesh.step_costs import partition_costs

log = get_logger("generate")

# fields of a request that a --prompts-file line might carry, expecting them to apply to it (they do not)
SAMPLING_KEYS = frozenset({"max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                           "n", "ignore_eos", "min_tokens", "logprobs", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "stop_token_ids"})


def engine_settings_from_args(args) -> EngineSettings:
    """The engine flags as EngineSettings: the model a directory (the built-in one without --model),
    the layout resolved and checked (`resolve_layout`) before any process starts or loads weights."""
    if args.model is None:
        from moemesh.entrypoints.default_model import default_model_dir

        model = default_model_dir()
    else:
        model = Path(args.model)
        if not model.is_dir():
            raise CLIError(f"--model {args.model}: not a directory")
    try:
        model_config = ModelConfig.from_dir(model)
    except ConfigError as e:
        raise CLIError(str(e) if str(e).startswith("--model") else f"--model {model}: {e}") from None
    settings = EngineSettings.from_args(args, model=str(model))
    if settings.device.startswith("cuda:") and settings.tp > 1:
        raise CLIError(f"--device {settings.device} puts every worker on one GPU, and the --tp {settings.tp} ranks of "
                       f"a stage need one each: give --device cuda (worker i on cuda:i)")
    pp = settings.pp or (len(settings.layer_partition) if isinstance(settings.layer_partition, tuple) else 1)
    try:
        costs = (partition_costs(settings, model, model_config, pp, device=settings.device,
                                 threads=threads_per_worker(settings.threads, pp)) if settings.tp == 1 else None)
        layout = resolve_layout(model_config, pp, settings.tp, settings.layer_partition, settings.expert_parallel,
                                settings.quantization, costs, handoff=not settings.no_mlp_handoff)
        check_num_steps(settings, pp, settings.tp)
    except ConfigError as e:
        raise CLIError(str(e)) from None
    return EngineSettings.derive(settings, pp=pp, layer_partition=layout.stage_layers if settings.layer_partition
                                 else None)


def sampling_params_from_args(args) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:  # "top_p must be in (0, 1]" -> name the flag
        flag = "--" + str(e).split()[0].replace("_", "-")
        raise CLIError(f"{flag}: {e}") from None


def read_prompts(args, tokenizer_factory) -> list[tuple[list[int], str]]:
    """(token ids, where they came from) for --prompt, --prompt-ids or each line of --prompts-file."""
    if args.prompt_ids is not None:
        if not args.prompt_ids:
            raise CLIError("--prompt-ids: no token ids given")
        return [(args.prompt_ids, "--prompt-ids")]
    if args.prompt is not None:
        return [(tokenizer_factory("--prompt").encode(_text(args.prompt, "--prompt")), "--prompt")]
    path = args.prompts_file
    if not path.is_file():
        raise CLIError(f"--prompts-file {path}: no such file")
    prompts = []
    try:
        # (JSON lines end at "\n" only: splitlines() would also cut at U+2028 inside a string; a BOM is skipped)
        lines = path.read_text(encoding="utf-8-sig").split("\n")
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompts-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CLIError(f"--prompts-file {path}, line {n}: invalid JSON ({e.msg})") from None
        origin = f"--prompts-file {path}, line {n}"
        if isinstance(obj, dict) and ("prompt" in obj and "prompt_ids" in obj or obj.keys() & SAMPLING_KEYS):
            # (of both a prompt and ids one would be dropped, and a line's own sampling fields ignored; other
            # keys, a record's id or metadata, are left alone)
            raise CLIError(f'{origin}: give one of "prompt" and "prompt_ids", and no sampling field (got '
                           f'{", ".join(sorted(obj.keys() & ({"prompt", "prompt_ids"} | SAMPLING_KEYS)))}; '
                           f'sampling is set by the flags)')
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append((tokenizer_factory("--prompts-file").encode(_text(obj["prompt"], origin)), origin))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt_ids"), list) and obj["prompt_ids"] and \
                all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in obj["prompt_ids"]):
            prompts.append((obj["prompt_ids"], origin))
        else:
            raise CLIError(f'--prompts-file {path}, line {n}: expected {{"prompt": "..."}} or '
                           f'{{"prompt_ids": [...]}} (one token id or more, each from 0 to 2^31 - 1)')
    if not prompts:
        raise CLIError(f"--prompts-file {path}: no prompts")
    return prompts


def _text(text: str, origin: str) -> str:
    """Prompt text that is valid Unicode (argv that was not UTF-8 arrives with surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CLIError(f"{origin}: the text is not valid UTF-8") from None
    return text


def run_generate(args) -> int:
    on_mesh = args.pp is not None or args.tp > 1
    if not on_mesh:
        torch.set_num_threads(threads_per_worker(args.threads, 1))
    cfg = engine_settings_from_args(args)
    params = sampling_params_from_args(args)
    tokenizer = None

    def get_tokenizer(flag: str):
        nonlocal tokenizer
        if tokenizer is None:
            from moemesh.tokenizer import TextTokenizer

            try:
                tokenizer = TextTokenizer(cfg.model)
            except FileNotFoundError:
                raise CLIError(f"{flag} needs a tokenizer.json in {cfg.model}; give --prompt-ids instead") from None
        return tokenizer

    prompts = read_prompts(args, get_tokenizer)
    start = time.perf_counter()
    results = _run_on_mesh(cfg, prompts, params) if on_mesh else _run_in_process(cfg, prompts, params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(r.token_ids) for r in results)
    log.info("generated", extra={"fields": {"prompts": len(results), "tokens": n_out, "seconds": round(elapsed, 3)}})
    decode = (lambda ids: get_tokenizer("text output").decode(ids)) if _has_tokenizer(cfg.model) else None
    for i, r in enumerate(results):
        text = decode(r.token_ids) if decode else None
        if args.json:
            print(json.dumps({"index": i, "prompt_ids": r.prompt_ids, "token_ids": r.token_ids, "text": text,
                              "finish_reason": r.finish_reason}), flush=True)
        else:
            print(text if text is not None else " ".join(map(str, r.token_ids)), flush=True)
    return 0


def _run_in_process(cfg: EngineSettings, prompts, params: SamplingParams) -> list[Output]:
    engine = LLMEngine(cfg)
    seqs = []
    for ids, origin in prompts:
        try:
            seqs.append(engine.add_request(ids, params))
        except ValueError as e:
            raise CLIError(f"{origin}: {e}") from None
    while engine.core.has_work():
        engine.step()
    return [Output(s.prompt_ids, s.output_ids, s.finish_reason) for s in seqs]


def _run_on_mesh(cfg: EngineSettings, prompts, params: SamplingParams) -> list[Output]:
    """All prompts at once through a local mesh of processes, which is shut down afterwards."""
    from moemesh.client import PipelineFailed
    from moemesh.entrypoints.launcher import LaunchError, LocalMesh

    if cfg.mesh_keys and not Path(cfg.mesh_keys).is_dir():
        raise CLIError(f"--mesh-keys {cfg.mesh_keys}: no such directory (make one with `moemesh keys --out DIR`)")
    try:
        with LocalMesh.of(cfg) as mesh:
            return run(drive_mesh(mesh, prompts, params))
    except (LaunchError, PipelineFailed, TimeoutError) as e:
        raise CLIError(str(e)) from None


async def drive_mesh(mesh, prompts, params: SamplingParams) -> list[Output]:
    from moemesh.client import CoordinatorClient
    from moemesh.entrypoints.launcher import LaunchError

    client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)

    async def watch():
        while mesh.died is None:
            await asyncio.sleep(0.2)
        raise LaunchError(f"the mesh failed: {mesh.died}")

    async def one(ids, origin) -> Output:
        tokens, reason = [], None
        async for out in client.generate(ids, params):
            if out.error:
                raise CLIError(f"{origin}: {out.error}")
            tokens += out.token_ids
            reason = out.finish_reason
        return Output(list(ids), tokens, reason)

    async def everything() -> list[Output]:
        status = await client.wait_serving(timeout=600)
        for ids, origin in prompts:  # (a prompt the context cannot hold, before any runs)
            if len(ids) + params.max_tokens > status.max_model_len:
                raise CLIError(f"{origin}: the prompt ({len(ids)} tokens) plus --max-tokens {params.max_tokens} is "
                               f"more than the pipeline's context of {status.max_model_len} tokens")
        room = asyncio.Semaphore(max(1, status.max_waiting or 1024))  # (more could wait past --max-waiting: a 429)

        async def bounded(ids, origin) -> Output:
            async with room:
                return await one(ids, origin)

        return await asyncio.gather(*(bounded(ids, origin) for ids, origin in prompts))

    main, watcher = asyncio.ensure_future(everything()), asyncio.ensure_future(watch())
    try:
        await asyncio.wait([main, watcher], return_when=asyncio.FIRST_COMPLETED)
        if main.done():
            return main.result()
        return watcher.result()  # raises the launcher's error
    finally:
        for task in (main, watcher):
            task.cancel()
        await asyncio.gather(main, watcher, return_exceptions=True)
        await client.close()


def _has_tokenizer(model_dir: str) -> bool:
    return (Path(model_dir) / "tokenizer.json").is_file()
