"""`moemesh bench serve`: load a running server over HTTP, like vLLM's serving benchmark.

Streams `/v1/completions` requests with random token-id prompts (`ignore_eos`, so every request
generates exactly `--new` tokens), either all at once with at most `--concurrency` in flight, or
arriving as a Poisson process at `--request-rate` per second. `--shared-prefix P` starts every
prompt with the same P tokens (vLLM's prefix-caching benchmark workload).

Any OpenAI-compatible server works (llama-server, vLLM, moemesh): every request opens its own
connection (a server may close a kept-alive one between requests, and a reused dead connection
would count as a failed request), and a server that sends no usage counts one token per streamed
chunk with choices (its text may be empty; a last chunk with no text and only a finish_reason is
none). Per request it records the time to the first token (TTFT), the time per output token after
the first (TPOT), and every gap between those chunks (ITL). Several concurrency levels
(`--concurrency 1,8,64`) give the points of a latency-vs-throughput curve, which `--plot FILE.png`
draws.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import statistics
import time
from pathlib import Path

import aiohttp
from tqdm import tqdm

from moemesh.entrypoints.bench import check_writable
from moemesh.errors import CLIError
from moemesh.log import get_logger

log = get_logger("bench")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [g for r in ok for g in r["itl"]]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)  # the ids sent (a server that adds a BOS counts one more)
    row = {"requests": len(results), "failed": len(results) - len(ok), "errors": [r["error"] for r in results
                                                                                  if r["error"] is not None],
           "seconds": round(seconds, 3), "input_tokens": in_tokens, "output_tokens": out_tokens,
           "request_per_s": round(len(ok) / seconds, 3), "output_tok_per_s": round(out_tokens / seconds, 1),
           "total_tok_per_s": round((out_tokens + in_tokens) / seconds, 1)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        row[f"{name}_mean_ms"] = round(1000 * statistics.fmean(xs), 2) if xs else None
        row[f"{name}_p50_ms"] = round(1000 * _pct(xs, 50), 2) if xs else None
        row[f"{name}_p99_ms"] = round(1000 * _pct(xs, 99), 2) if xs else None
    return row


def _content(choice: dict):
    delta = choice.get("delta")
    return delta.get("content") if isinstance(delta, dict) else None


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], new: int, headers,
                      model: str | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens, chunks, error, ended = 0, 0, None, False
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:200]}"
            else:
                async for line in resp.content:
                    if not line.startswith(b"data:"):  # (SSE: "data:", its one space optional)
                        continue
                    payload = line[5:].removeprefix(b" ")
                    if payload.strip() == b"[DONE]":
                        ended = True
                        continue
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        error = f"not a JSON event in the stream: {line[:100]!r}"
                        break
                    if not isinstance(chunk, dict):
                        error = f"not a JSON object in the stream: {line[:100]!r}"
                        break
                    if "error" in chunk:  # (OpenAI's {"error": {"message": ...}}, or a bare string)
                        e = chunk["error"]
                        error = str((e.get("message") if isinstance(e, dict) else None) or e or "an error event")
                        break
                    now = time.perf_counter()
                    usage = chunk.get("usage")
                    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        tokens = usage["completion_tokens"]
                    choices = [c for c in chunk.get("choices") or () if isinstance(c, dict)]
                    ended = ended or any(c.get("finish_reason") for c in choices)
                    # one event per step that produced tokens, its text perhaps empty (a character not yet
                    # whole, a special token: vLLM's benchmark counts those too); only a last event with no
                    # text and its finish_reason is no token
                    finish_only = all(c.get("finish_reason") and not (c.get("text") or _content(c)) for c in choices)
                    if choices and not finish_only:
                        chunks += 1
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is None and not ended and chunks:  # (a stream cut short that closed cleanly is no served request)
        error = "the stream ended before its end (no finish_reason, no [DONE])"
    if error is None and tokens == 0:  # no usage from this server: a chunk per token
        tokens = chunks
    if error is None and tokens == 0:  # (a reply that is not an event stream of tokens: not a served request)
        error = "the reply streamed no tokens (is this an OpenAI-compatible server streaming completions?)"
    if error is not None:
        first = None
    return {"ttft": (first or end) - start, "e2e": end - start, "itl": gaps, "tokens": tokens,
            "prompt_tokens": len(prompt), "error": error}


async def run_level(url: str, prompts: list[list[int]], new: int, concurrency: int, rate: float | None,
                    headers, seed: int, model: str | None = None) -> dict:
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # a connection per request (force_close): servers that close idle keep-alive connections
    # (llama-server does) would otherwise fail the next request sent on one
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1), force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", unit="req", leave=False)

        async def go(p, delay):
            await asyncio.sleep(delay)
            async with gate:
                r = await one_request(session, url, p, new, headers, model)
            bar.update(1)
            return r

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate:
                t += rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(go(p, d) for p, d in zip(prompts, delays)))
        bar.close()
        return summarize(results, time.perf_counter() - start)


def run_serve_bench(args) -> int:
    from moemesh.netutil import run

    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    vocab = args.vocab
    if vocab <= 4:  # (ids 0-3 are left out: a checkpoint's special tokens sit there)
        raise CLIError(f"--vocab {vocab}: prompt ids are drawn from 4 up to it; give more than 4")
    rows = []
    if args.shared_prefix < 0:
        raise CLIError("--shared-prefix must be 0 or more tokens")
    if args.plot:  # (refused now, not after the runs: no matplotlib, a format it cannot write, a file that cannot be)
        plt = _pyplot()
        if Path(args.plot).is_dir():
            raise CLIError(f"--plot {args.plot}: is a directory (give a file, e.g. {Path(args.plot) / 'curve.png'})")
        kind = Path(args.plot).suffix.lstrip(".").lower() or "png"  # (no suffix: matplotlib writes a .png)
        formats = plt.figure().canvas.get_supported_filetypes()
        plt.close("all")
        if kind not in formats:
            raise CLIError(f"--plot {args.plot}: matplotlib cannot write .{kind} files ({', '.join(sorted(formats))})")
        check_writable("--plot", args.plot, Path(args.plot).parent)
    for level in args.concurrency:
        prefix = [rng.randrange(4, vocab) for _ in range(args.shared_prefix)]
        prompts = [prefix + [rng.randrange(4, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
        try:
            row = run(run_level(f"{base}/v1/completions", prompts, args.new, level, args.request_rate, headers,
                                args.seed, args.model_name))
        except aiohttp.ClientError as e:
            raise CLIError(f"--url {args.url}: {e}") from None
        errors = row.pop("errors")
        row = {"concurrency": level, "request_rate": args.request_rate, "shared_prefix": args.shared_prefix, **row}
        if row["failed"] == row["requests"]:
            message = f"every request failed against {args.url} at concurrency {level}: {_reasons(errors)}"
            if rows and args.plot:  # (what did run is still drawn)
                try:
                    plot(rows, args.plot)
                except CLIError as e:  # (the failed requests stay the error to report)
                    message += f"; and {e}"
            raise CLIError(message)
        if errors:
            log.warning("requests failed", extra={"fields": {"concurrency": level, "failed": len(errors),
                                                               "reasons": _reasons(errors)}})
        rows.append(row)
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.plot:
        plot(rows, args.plot)
    return 0


def _reasons(errors: list[str], most: int = 3) -> str:
    """The commonest failure reasons, with their counts."""
    counts = collections.Counter(errors)
    return "; ".join(f"{n} x {reason}" for reason, n in counts.most_common(most))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'moemesh[bench]'") from None
    return plt


def plot(rows: list[dict], path: str) -> None:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["output_tok_per_s"] for r in rows]
    for ax, key, title in ((a, "ttft", "time to first token"), (b, "tpot", "time per output token")):
        shown = [(xi, r) for xi, r in zip(x, rows) if r[f"{key}_p50_ms"] is not None]  # (--new 1: no TPOT)
        ax.plot([xi for xi, _ in shown], [r[f"{key}_p50_ms"] for _, r in shown], "o-", label="p50")
        ax.plot([xi for xi, _ in shown], [r[f"{key}_p99_ms"] for _, r in shown], "s--", label="p99")
        for xi, r in shown:
            ax.annotate(f"c={r['concurrency']}", (xi, r[f"{key}_p50_ms"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens / s")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise CLIError(f"--plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
