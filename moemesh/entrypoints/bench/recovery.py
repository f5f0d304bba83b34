"""`moemesh bench recovery`: what losing a stage worker costs a running pipeline.

A local mesh serves `--concurrency` greedy streams; once every stream is under way (and the
throughput before has been measured), one stage worker is SIGKILLed. The launcher restarts it and
the coordinator recovers. Per stream: the gap from the kill to its next token that the rebuilt
pipeline made (tokens read after the kill but before the coordinator saw the loss were made before
it, in steps already under way); overall: requests
lost (the goal is 0), requests and tokens recomputed, the coordinator's recovery time, and output
throughput before the kill and after the pipeline serves again. Each stream's tokens are checked
against an undisturbed run of the same requests (greedy), so a repeated or skipped token counts as
lost.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

from moemesh.client import CoordinatorClient
from moemesh.entrypoints.bench.throughput import check_lengths, make_prompts
from moemesh.entrypoints.launcher import LocalMesh
from moemesh.errors import CLIError
from moemesh.netutil import run
from moemesh.sampling import SamplingParams
from moemesh.settings import EngineSettings


async def _measure(mesh: LocalMesh, prompts, params, victim: str) -> dict:
    client = CoordinatorClient(mesh.client_address, mesh_keys=mesh.coordinator.mesh_keys)
    try:
        await client.wait_serving(timeout=600)
        want = await asyncio.gather(*(_tokens(client, p, params) for p in prompts))
        times: list[list[float]] = [[] for _ in prompts]
        got: list[list[int]] = [[] for _ in prompts]

        async def stream(i, p):  # (a stream that ends with an error has fewer tokens: counted as lost)
            async for out in client.generate(p, params):
                if out.error:
                    return
                got[i] += out.token_ids
                times[i] += [time.monotonic()] * len(out.token_ids)

        tasks = [asyncio.ensure_future(stream(i, p)) for i, p in enumerate(prompts)]
        target = len(prompts) * params.max_tokens // 4
        while sum(map(len, got)) < target // 2:
            await asyncio.sleep(0.005)
        t0, n0 = time.monotonic(), sum(map(len, got))
        while sum(map(len, got)) < target:
            await asyncio.sleep(0.005)
        before = (sum(map(len, got)) - n0) / (time.monotonic() - t0)
        mesh.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        noticed = None  # when the coordinator has seen the loss: tokens read before then were made before it
        while True:  # when the pipeline serves again (the recovery is over)
            st = await client.status()
            if noticed is None and (st.phase != "serving" or st.recoveries):
                noticed = time.monotonic()
            if st.recoveries and st.serving:
                break
            await asyncio.sleep(0.01 if noticed is None else 0.05)
        serving_again = time.monotonic()
        await asyncio.gather(*tasks)
        done = time.monotonic()
        status = await client.status()
        # each stream's first token the rebuilt pipeline made (one that had finished before the loss was
        # seen has none: not counted), from the kill
        gaps = sorted(next(t - killed for t in ts if t > noticed) for ts in times if ts and ts[-1] > noticed)
        if not gaps:
            raise CLIError(f"every stream had finished when the worker was killed: nothing measures the "
                           f"recovery (give more --new tokens than {params.max_tokens})")
        after_tokens = sum(1 for ts in times for t in ts if t >= serving_again)
        return {"victim": victim, "requests": len(prompts),
                "requests_lost": sum(g != w for g, w in zip(got, want)),
                "kill_to_next_token_s": {"min": round(gaps[0], 2), "p50": round(gaps[len(gaps) // 2], 2),
                                         "max": round(gaps[-1], 2)},
                "coordinator_recovery_s": round(status.recovery_seconds, 2), "recoveries": status.recoveries,
                "requests_recomputed": status.requests_resumed, "tokens_recomputed": status.tokens_recomputed,
                "tok_per_s_before": round(before, 1),
                "serving_again_after_s": round(serving_again - killed, 2),
                "tok_per_s_after": round(after_tokens / max(done - serving_again, 1e-9), 1)}
    finally:
        await client.close()


async def _tokens(client, prompt, params) -> list[int]:
    tokens = []
    async for out in client.generate(prompt, params):
        if out.error:
            raise CLIError(f"the undisturbed run failed: {out.error}")
        tokens += out.token_ids
    return tokens


def run_recovery_bench(args) -> int:
    from moemesh.config import ModelConfig
    from moemesh.layout import resolve_layout

    mc = ModelConfig.from_dir(args.model)
    resolve_layout(mc, args.pp)  # (a layout the model cannot take, named before anything starts)
    check_lengths(mc, args.prompt_len, args.new)
    if args.new < 8:  # (the kill comes a quarter of the way: fewer tokens leave nothing to measure after it)
        raise CLIError(f"--new {args.new}: at least 8 tokens, so that the streams still run when the worker is killed")
    if not 0 <= args.kill_stage < args.pp:
        raise CLIError(f"--kill-stage {args.kill_stage} is not a stage of --pp {args.pp}")
    prompts = make_prompts(mc.vocab_size, args.concurrency, args.prompt_len)
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    settings = EngineSettings(model=args.model, pp=args.pp, kv_memory=args.kv_memory, threads=1)
    with LocalMesh.of(settings, worker_timeout=args.worker_timeout) as mesh:
        row = run(_measure(mesh, prompts, params, f"stage-worker pp={args.kill_stage} tp=0"))
    row = {"pp": args.pp, "kill_stage": args.kill_stage, **row}
    print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0
