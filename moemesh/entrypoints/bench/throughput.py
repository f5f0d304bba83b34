"""`moemesh bench throughput`: offline throughput of the mesh, like vLLM's throughput benchmark.

For each layout: start a local mesh (one torch thread per worker), send `--num-prompts` random
prompts with at most `--concurrency` in flight, and time from the first request to the last token.
`tok_per_s` counts generated tokens, `total_tok_per_s` prompt and generated tokens.
The in-process engine runs the same prompts in this process first, as the baseline. With
`--ceiling`, N independent in-process engines (N = the workers of a layout, each its own process
and core) then run the prompts split among them (moemesh.entrypoints.bench.ceiling): what the
machine's cores do with no pipeline, and each layout with N workers prints its share of that.
Each stage's busy time (from its heartbeats) over the wall time shows the pipeline bubble; with
tensor parallelism, the share of that busy time spent in collectives is reported too.
`--rounds N` runs all of it N times over, one round after the other (so that a machine whose speed
drifts by 10-25% from minute to minute slows both sides of a ratio alike), then prints the medians:
of each figure, and of each round's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from moemesh.errors import CLIError
from moemesh.client import CoordinatorClient
from moemesh.config import ModelConfig
from moemesh.errors import ConfigError
from moemesh.layout import Layout, resolve_layout
from moemesh.entrypoints.bench import check_writable
from moemesh.entrypoints.bench.ceiling import bench_ceiling
from moemesh.entrypoints.engine import LLMEngine
from moemesh.entrypoints.launcher import LaunchError, LocalMesh
from moemesh.netutil import run
from moemesh.protocol import TIMELINE_SPANS, StatusReply
from moemesh.sampling import SamplingParams
from moemesh.settings import CoordinatorSettings, EngineSettings, WorkerSettings
from moemesh.step_costs import partition_costs
from moemesh.timeline import chrome_trace, handovers, idle_split


def make_prompts(vocab_size: int, n: int, length: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """n random prompts of `length` tokens, each after the same `shared_prefix` random tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, vocab_size, (shared_prefix,), generator=g).tolist() if shared_prefix else []
    return [prefix + p for p in torch.randint(4, vocab_size, (n, length), generator=g).tolist()]


def bench_in_process(settings: EngineSettings, prompts, params) -> dict:
    torch.set_num_threads(1)
    engine = LLMEngine(settings, progress=None)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return {"tokens": sum(len(o.token_ids) for o in outs), "seconds": elapsed}


async def _drive(address: str, prompts, params, concurrency: int, label: str = "", mesh_keys: str | None = None,
                 timeline: bool = False) -> dict:
    client = CoordinatorClient(address, mesh_keys=mesh_keys)
    try:
        await client.wait_serving(timeout=600)
        before = await client.status()
        gate = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(prompts) * params.max_tokens, desc=label, unit="tok", leave=False)

        ttft = []  # seconds from sending a request to its first token

        async def one(p):
            n = 0
            async with gate:
                sent = time.perf_counter()
                async for out in client.generate(p, params):
                    if out.error:
                        raise RuntimeError(out.error)
                    if out.token_ids and not n:
                        ttft.append(time.perf_counter() - sent)
                    n += len(out.token_ids)
                    bar.update(len(out.token_ids))
            return n

        wall, start = time.time(), time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
        bar.close()
        await asyncio.sleep(0.6)  # one more heartbeat from every worker: busy times up to date
        after = await (_settled(client) if timeline else client.status())
        busy = [b - a for a, b in zip(before.stage_busy_seconds, after.stage_busy_seconds)]
        comm = [b - a for a, b in zip(before.stage_comm_seconds, after.stage_comm_seconds)]
        sent = [b - a for a, b in zip(before.stage_sent_bytes, after.stage_sent_bytes)][:-1]  # boundaries
        steps = max(1, after.steps - before.steps)
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        return {"tokens": sum(counts), "seconds": elapsed, "stage_busy": busy, "stage_comm": comm, "sent": sent,
                "ttft_p50_ms": 1000 * sorted(ttft)[len(ttft) // 2],
                "prefix_cache_hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0,
                "coordinator_ms_per_step": 1000 * (after.coordinator_step_seconds - before.coordinator_step_seconds)
                / steps, "schedule_bytes_per_step": (after.schedule_bytes - before.schedule_bytes) / steps,
                "steps": after.steps - before.steps,
                "mlp_handoff_steps": after.mlp_handoff_steps - before.mlp_handoff_steps,
                "window": (wall, wall + elapsed), "status": after}
    finally:
        await client.close()


async def _settled(client: CoordinatorClient, wait: float = 5.0) -> StatusReply:
    """The status with the timeline once every stage's spans reach the last step the coordinator took
    (they come with the heartbeats, every 0.5 s): so long at most, then as it is."""
    deadline = time.monotonic() + wait
    while True:
        status = await client.status(timeline=True)
        last = max((s.step_id for s in status.coordinator_spans), default=-1)
        if all((spans[-1].step_id if spans else -1) >= last for spans in status.stage_spans) \
                or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.2)


def check_lengths(mc: ModelConfig, prompt_len: int, new: int, shared_prefix: int = 0) -> None:
    """A benchmark's requests must fit the model's positions: refused before any work, naming the flags."""
    if shared_prefix + prompt_len + new > mc.max_position_embeddings:
        prefix = f" (plus --shared-prefix {shared_prefix})" if shared_prefix else ""
        raise CLIError(f"--prompt-len {prompt_len}{prefix} and --new {new} exceed the model's "
                       f"{mc.max_position_embeddings} positions")


def _partition_for(layer_partition, pp: int):
    """--layer-partition for the layout of `pp` stages: auto for all, counts for the one they fit."""
    if isinstance(layer_partition, str) or (layer_partition and len(layer_partition) == pp):
        return layer_partition
    return None


def run_throughput_bench(args) -> int:
    mc = ModelConfig.from_dir(args.model)
    base_settings = EngineSettings(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                   kv_memory=args.kv_memory,
                                   max_batched_tokens=args.max_batched_tokens, threads=1,
                                   max_in_flight=args.max_in_flight,
                                   no_prefix_caching="on" not in args.prefix_caching)
    check_lengths(mc, args.prompt_len, args.new, args.shared_prefix)
    if args.timeline is not None and args.netns:
        raise CLIError("--timeline reads the steps of a local mesh: it does not run with --netns")
    if isinstance(args.layer_partition, tuple) and len(args.layer_partition) not in args.pp:
        raise CLIError(f"--layer-partition has {len(args.layer_partition)} stages but no --pp layout has that many")
    layouts = {}  # every layout resolved (or refused) before any of them runs
    for pp in args.pp:
        partition = _partition_for(args.layer_partition, pp)
        costs = partition_costs(EngineSettings.derive(base_settings, layer_partition=partition,
                                                      partition_costs=args.partition_costs),
                                args.model, mc, pp, rows=math.ceil(args.concurrency / pp))
        for tp in args.tp:
            try:
                # (the split of the hand-off's pipeline where any run has it: one split for both)
                layouts[pp, tp] = resolve_layout(mc, pp, tp, partition, args.expert_parallel and tp > 1,
                                                 args.quantization, costs=costs if tp == 1 else None,
                                                 handoff="on" in args.mlp_handoff)
            except ConfigError as e:
                raise CLIError(f"pp={pp} tp={tp}: {e}") from None
    if args.timeline is not None:
        check_writable("--timeline", args.timeline, Path(args.timeline), make=True)
    n = args.num_prompts or args.concurrency
    prompts = make_prompts(mc.vocab_size, n, args.prompt_len, shared_prefix=args.shared_prefix)
    job = _Job(args, base_settings, layouts, prompts, n * (args.shared_prefix + args.prompt_len),
               SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True))
    keys_dir = None
    if "on" in args.curve:
        from moemesh.mesh_security import make_keys

        keys_dir = str(make_keys(Path(tempfile.mkdtemp(prefix="moemesh-bench-keys-")) / "keys"))
    rounds = []
    for r in range(args.rounds):
        tag = {"round": r + 1} if args.rounds > 1 else {}
        rounds.append(_one_round(job, keys_dir, tag))
    if args.rounds > 1:
        for row in medians(rounds):
            _emit(row, args.json)
    return 0


@dataclass(frozen=True)
class _Job:
    """What every round of one `bench throughput` run shares."""
    args: argparse.Namespace
    base_settings: EngineSettings
    layouts: dict[tuple[int, int], Layout]  # (pp, tp) ->
    prompts: list[list[int]]
    prompt_tokens: int  # in all the prompts
    params: SamplingParams


def _one_round(job: _Job, keys_dir: str | None, tag: dict) -> list[dict]:
    """The baseline, the ceilings and every layout once, each row printed as it is measured."""
    args, base_settings, prompts, params, prompt_tokens = (job.args, job.base_settings, job.prompts, job.params,
                                                           job.prompt_tokens)
    rows = []
    base = None
    if not args.no_baseline:
        try:
            # (at most --concurrency sequences at once, as the meshes are driven)
            r = bench_in_process(EngineSettings.derive(base_settings, max_seqs=min(base_settings.max_seqs,
                                                                                   args.concurrency)), prompts, params)
        except ValueError as e:  # (the requests do not fit this engine's context or KV cache)
            raise CLIError(f"the in-process baseline: {e}") from None
        base = r["tokens"] / r["seconds"]
        rows.append({**tag, "impl": "in-process", "pp": 1, "tp": 1, "tok_per_s": round(base, 1),
                     "total_tok_per_s": round((r["tokens"] + prompt_tokens) / r["seconds"], 1),
                     "seconds": round(r["seconds"], 2)})
        _emit(rows[-1], args.json)
    ceilings = {}  # engines -> tok/s
    worker_counts = sorted({pp * tp for pp in args.pp for tp in args.tp} - {1}) if args.ceiling else []
    for engines in worker_counts:
        try:
            # (each engine its share of --concurrency at once)
            share = min(base_settings.max_seqs, math.ceil(args.concurrency / engines))
            r = bench_ceiling(EngineSettings.derive(base_settings, max_seqs=share), prompts, params, engines)
        except RuntimeError as e:
            raise CLIError(f"--ceiling: {e}") from None
        ceilings[engines] = r["tokens"] / r["seconds"]
        row = {**tag, "impl": "ceiling", "engines": engines, "tokens": r["tokens"],
               "tok_per_s": round(ceilings[engines], 1),
               "total_tok_per_s": round((r["tokens"] + prompt_tokens) / r["seconds"], 1),
               "seconds": round(r["seconds"], 2), "engine_seconds": [round(x, 2) for x in r["engine_seconds"]]}
        if base:
            row["vs_in_process"] = round(ceilings[engines] / base, 2)
        rows.append(row)
        _emit(row, args.json)
    layouts = [(pp, tp, c, k, h) for tp in args.tp for pp in args.pp for c in args.prefix_caching for k in args.curve
               for h in (args.mlp_handoff if pp > 1 else [None])]
    # pp=1 tp=1 first, whatever the flags' order: the others' vs_pp1_tp1 is of it
    for pp, tp, caching, curve, handoff in sorted(layouts, key=lambda x: (x[0], x[1]) != (1, 1)):
        layout, expert_parallel = job.layouts[pp, tp], args.expert_parallel and tp > 1
        partition = layout.stage_layers if _partition_for(args.layer_partition, pp) else None
        try:
            settings = EngineSettings.derive(base_settings, pp=pp, tp=tp, expert_parallel=expert_parallel,
                                             layer_partition=partition, no_prefix_caching=caching == "off",
                                             no_mlp_handoff=handoff == "off",
                                             mesh_keys=keys_dir if curve == "on" else None,
                                             insecure_mesh=args.netns and curve == "off")
            if args.netns:
                r = _run_across_namespaces(settings, prompts, params, args.concurrency)
            else:
                with LocalMesh.of(settings) as mesh:
                    r = run(_drive(mesh.client_address, prompts, params, args.concurrency, f"pp={pp} tp={tp}",
                                   settings.mesh_keys, timeline=args.timeline is not None))
        except (LaunchError, RuntimeError, ValueError, ConfigError) as e:
            raise CLIError(f"pp={pp} tp={tp}: {e}") from None
        tps = r["tokens"] / r["seconds"]
        row = {**tag, "impl": "mesh-netns" if args.netns else "mesh", "pp": pp, "tp": tp,
               "layers": list(partition) if partition else "even", "prefix_caching": caching, "curve": curve,
               "mlp_handoff": handoff,
               "tok_per_s": round(tps, 1), "total_tok_per_s": round((r["tokens"] + prompt_tokens) / r["seconds"], 1),
               "seconds": round(r["seconds"], 2), "ttft_p50_ms": round(r["ttft_p50_ms"], 1),
               "prefix_cache_hit_rate": round(r["prefix_cache_hit_rate"], 3),
               "stage_busy_fraction": [round(b / r["seconds"], 3) for b in r["stage_busy"]],
               "steps": r["steps"], "mlp_handoff_steps": r["mlp_handoff_steps"],
               "coordinator_ms_per_step": round(r["coordinator_ms_per_step"], 3),
               "schedule_bytes_per_step": round(r["schedule_bytes_per_step"])}
        if pp > 1:  # what crosses each stage boundary, per token processed (prompt and generated)
            row["boundary_bytes_per_token"] = [round(b / (r["tokens"] + prompt_tokens)) for b in r["sent"]]
        if tp > 1:  # share of each stage's compute time spent in all-reduce / all-gather
            row["comm_share_of_busy"] = [round(c / b, 3) if b else 0.0 for c, b in zip(r["stage_comm"], r["stage_busy"])]
        if args.timeline is not None:
            row.update(_write_timeline(Path(args.timeline), r, f"pp{pp}-tp{tp}-caching-{caching}-curve-{curve}"
                                       + (f"-handoff-{handoff}" if pp > 1 else "")
                                       + (f"-round{tag['round']}" if tag else "")))
        if base:
            row["vs_in_process"] = round(tps / base, 2)
        if pp * tp in ceilings:  # of what as many independent engines do on these cores
            row["vs_ceiling"] = round(tps / ceilings[pp * tp], 2)
        single = next((x for x in rows if x["impl"].startswith("mesh") and x["pp"] == 1 and x["tp"] == 1
                       and x["prefix_caching"] == caching and x["curve"] == curve), None)
        if single and (pp, tp) != (1, 1):
            row["vs_pp1_tp1"] = round(tps / single["tok_per_s"], 2)
        twin = next((x for x in rows if x.get("mlp_handoff") not in (None, handoff)
                     and (x["pp"], x["tp"], x["prefix_caching"], x["curve"]) == (pp, tp, caching, curve)), None)
        if twin:  # what the MLP hand-off buys, same layout, same run (either order)
            on, off = (tps, twin["tok_per_s"]) if handoff == "on" else (twin["tok_per_s"], tps)
            row["mlp_handoff_on_vs_off"] = round(on / off, 3)
        twin = next((x for x in rows if x.get("curve") not in (None, curve)
                     and (x["pp"], x["tp"], x["prefix_caching"], x["mlp_handoff"]) == (pp, tp, caching, handoff)),
                    None)
        if twin:  # what CURVE costs, same layout, same run (either order)
            on, off = (tps, twin["tok_per_s"]) if curve == "on" else (twin["tok_per_s"], tps)
            row["curve_on_vs_off"] = round(on / off, 3)
        other = next((x for x in rows if x.get("prefix_caching") not in (None, caching)
                      and (x["pp"], x["tp"], x["curve"], x["mlp_handoff"]) == (pp, tp, curve, handoff)), None)
        if other:  # what the prefix cache buys, same layout, same run
            on, off = (row, other) if caching == "on" else (other, row)
            row["caching_on_ttft_speedup"] = round(off["ttft_p50_ms"] / max(on["ttft_p50_ms"], 1e-6), 2)
            # (the same tokens either way: the ratio of their rates, not of the rounded seconds)
            row["caching_on_time_speedup"] = round(on["tok_per_s"] / max(off["tok_per_s"], 1e-9), 2)
        rows.append(row)
        _emit(row, args.json)
    return rows


def _write_timeline(directory: Path, r: dict, name: str) -> dict:
    """--timeline: the run's steps as a Perfetto / chrome://tracing file, and each stage's idle time
    in the run split by what it waited for (moemesh.timeline). The coordinator keeps the newest
    TIMELINE_SPANS steps of each stage: of a longer run, the split covers the part they cover
    (`timeline_seconds` says how much of the run that is)."""
    path = directory / f"{name}.json"
    status = r["status"]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(chrome_trace(status)))
    except OSError as e:  # (it could be written when the runs began: a full disk, say)
        raise CLIError(f"--timeline {directory}: {e.strerror or e}") from None
    start, end = r["window"]
    for spans in status.stage_spans:
        if len(spans) >= TIMELINE_SPANS:  # (older steps were dropped: the window starts at its oldest)
            start = max(start, spans[0].start)
    splits = [idle_split(spans, start, end) for spans in status.stage_spans]
    row = {"timeline": str(path), "timeline_seconds": round(end - start, 2),
           "stage_idle_before_prompt_steps_s": [round(x["idle_before_prompt_steps"], 3) for x in splits],
           "stage_idle_before_decode_steps_s": [round(x["idle_before_decode_steps"], 3) for x in splits]}
    # each decode hand-over's median (moemesh.timeline.handovers): stage to stage, then round the ring
    h = handovers(status, start, end)
    if h["hops"] and None not in h["hops"]:
        row["decode_hop_ms"] = [round(1e3 * x, 3) for x in h["hops"]]
    for key, label in (("to_coordinator", "decode_result_to_coordinator_ms"), ("coordinator", "decode_coordinator_turn_ms"),
                       ("to_first_stage", "decode_schedule_to_first_stage_ms")):
        if h[key] is not None:
            row[label] = round(1e3 * h[key], 3)
    return row


# what a row of every round contributes to the medians: figures, each ratio to another row of the same
# round (a ratio of medians would pair runs minutes apart), and per-stage figures stage by stage
_MEDIAN_KEYS = ("tok_per_s", "total_tok_per_s", "seconds", "ttft_p50_ms", "vs_in_process", "vs_ceiling",
                "vs_pp1_tp1", "curve_on_vs_off", "mlp_handoff_on_vs_off", "caching_on_time_speedup",
                "caching_on_ttft_speedup", "decode_result_to_coordinator_ms", "decode_coordinator_turn_ms",
                "decode_schedule_to_first_stage_ms")
_MEDIAN_LISTS = ("stage_busy_fraction", "stage_idle_before_prompt_steps_s", "stage_idle_before_decode_steps_s",
                 "decode_hop_ms")
_SAME_ROW = ("impl", "engines", "pp", "tp", "layers", "prefix_caching", "curve", "mlp_handoff")  # what a row measured


def medians(rounds: list[list[dict]]) -> list[dict]:
    """--rounds: one row per row of a round, `impl` prefixed with "median-", each figure the median
    over the rounds. Every round runs the same rows in the same order; rounds that do not are a bug
    here (ValueError), never rows of different layouts paired."""
    out = []
    for same in zip(*rounds, strict=True):
        first = same[0]
        if any(tuple(x.get(k) for k in _SAME_ROW) != tuple(first.get(k) for k in _SAME_ROW) for x in same):
            raise ValueError(f"the rounds ran different rows: {[tuple(x.get(k) for k in _SAME_ROW) for x in same]}")
        row = {"impl": f"median-{first['impl']}", "rounds": len(same)}
        row.update({k: first[k] for k in _SAME_ROW[1:] if k in first})
        for k in _MEDIAN_KEYS:
            if all(k in x for x in same):
                row[k] = round(statistics.median(x[k] for x in same), 3 if k.startswith(("vs_", "curve", "caching", "mlp"))
                               else 2)
        for k in _MEDIAN_LISTS:
            if all(k in x for x in same):
                row[k] = [round(statistics.median(v), 3) for v in zip(*(x[k] for x in same))]
        out.append(row)
    return out


def _emit(row: dict, as_json: bool) -> None:
    print(json.dumps(row) if as_json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def _run_across_namespaces(settings: EngineSettings, prompts, params, concurrency: int) -> dict:
    """The coordinator and the driver on one simulated host, each stage on its own (moemesh.entrypoints.netns)."""
    import subprocess
    import sys

    from moemesh.entrypoints.netns import Hosts, NetnsUnavailable

    pp = settings.pp
    if settings.tp > 1:
        raise CLIError("--netns runs one worker per stage host; leave --tp at 1")
    names = ["front", *(f"s{i}" for i in range(pp))]
    py = [sys.executable, "-m", "moemesh"]
    coordinator = CoordinatorSettings.derive(settings, host="0.0.0.0", port=5555, client_port=5556)
    try:
        with Hosts(names) as hosts, tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            front = hosts.address("front")
            hosts.popen("front", [*py, "coordinator", *coordinator.to_argv()], stdout=subprocess.DEVNULL,
                        env=_one_thread_env())
            for i in range(pp):
                worker = WorkerSettings.derive(settings, coordinator=f"tcp://{front}:5555", pp_rank=i, host="0.0.0.0",
                                               advertise_host=hosts.address(f"s{i}"), threads=1)
                hosts.popen(f"s{i}", [*py, "stage-worker", *worker.to_argv()], env=_one_thread_env())
            json.dump({"prompts": prompts, "max_tokens": params.max_tokens, "concurrency": concurrency,
                       "mesh_keys": settings.mesh_keys}, f)
            f.flush()
            driver = hosts.popen("front", [sys.executable, "-m", "moemesh.entrypoints.bench.throughput", f.name],
                                 stdout=subprocess.PIPE)
            out, _ = driver.communicate(timeout=3600)
            if driver.returncode:
                raise RuntimeError(f"the driver in the front namespace failed (status {driver.returncode})")
            return json.loads(out)
    except NetnsUnavailable as e:
        raise CLIError(f"--netns: network namespaces cannot be made here ({e}); run as root with iproute2")


def _one_thread_env() -> dict:
    from moemesh.entrypoints.launcher import child_environment

    return {**child_environment(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


if __name__ == "__main__":  # the driver, run inside the front namespace by --netns
    import sys

    job = json.loads(open(sys.argv[1]).read())
    sampling = SamplingParams(max_tokens=job["max_tokens"], temperature=0, ignore_eos=True)
    result = run(_drive("tcp://127.0.0.1:5556", job["prompts"], sampling, job["concurrency"], "across namespaces",
                        job["mesh_keys"]))
    del result["status"]  # (a StatusReply: what the row needs of it is in the other fields)
    print(json.dumps(result))
