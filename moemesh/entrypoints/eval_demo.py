"""`moemesh eval-demo`: the demo model's accuracy table, measured through the HTTP API with lm-eval.

    moemesh eval-demo --lm-eval .venv-eval/bin/lm_eval --out docs/accuracy-table.md

For each row (float32, bfloat16, --quantization fp8, an AutoFP8 checkpoint written by `moemesh
quantize`, --quantization int8; each at --pp 1 and --pp 2) it starts `moemesh serve` on a free port,
runs `lm_eval --model local-completions` against /v1/completions on the two local tasks of
eval/demo (held-out standard-library files: perplexity by loglikelihood_rolling; the next line of
held-out functions: greedy exact match), stops the server and reads lm-eval's results. The reference
row is transformers itself on the same checkpoint, files and windows, in this process.

lm-eval is not a dependency of moemesh: install it anywhere (`pip install 'moemesh[eval]'`, or a
venv of its own) and point --lm-eval at its command.
"""

from __future__ import annotations

import ast
import difflib
import glob
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moemesh.entrypoints.tiny_model import ENDOFTEXT_ID
from moemesh.errors import CLIError

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval" / "demo"  # the repository's; not installed
TASKS = ("demo_stdlib_ppl", "demo_stdlib_nextline")
SERVED_NAME = "demo"


@dataclass(frozen=True)
class Row:
    key: str  # for --rows
    name: str
    serve_flags: tuple[str, ...] = ()
    autofp8: bool = False  # serve the checkpoint `moemesh quantize` writes instead


ROWS = (
    Row("float32", "float32", ("--dtype", "float32")),
    Row("bfloat16", "bfloat16", ("--dtype", "bfloat16")),
    Row("fp8", "fp8 (`--quantization fp8`)", ("--quantization", "fp8")),
    Row("autofp8", "AutoFP8 checkpoint (`moemesh quantize`)", autofp8=True),
    Row("int8", "int8 (`--quantization int8`)", ("--quantization", "int8")),
)


# -- rows through the API ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, pp: int, flags: tuple[str, ...], port: int, log_path: Path) -> subprocess.Popen:
    """`moemesh serve` in the background; returns once it prints that it serves."""
    cmd = [sys.executable, "-m", "moemesh", "serve", "--model", str(model), "--pp", str(pp), "--port", str(port),
           "--served-model-name", SERVED_NAME, *flags]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        log.write(line)
        if line.startswith("moemesh is serving"):
            return proc
        if time.monotonic() > deadline:
            break
    stop(proc)
    raise CLIError(f"moemesh serve {' '.join(cmd[4:])} did not start; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # (not SIGINT: a job started in the background may have inherited it ignored)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_lm_eval(lm_eval: str, model: Path, port: int, out: Path, limit: int | None, concurrency: int) -> dict:
    """lm-eval's results and samples for TASKS against the server on `port`."""
    args = ",".join([f"model={SERVED_NAME}", f"base_url=http://127.0.0.1:{port}/v1/completions",
                     f"tokenizer={model}", "tokenizer_backend=huggingface", "tokenized_requests=True",
                     "max_length=512", f"num_concurrent={concurrency}", "max_retries=1",
                     # documents start after <|endoftext|>, as in training (lm-eval's default is the BOS,
                     # which the model never saw)
                     f"custom_prefix_token_id={ENDOFTEXT_ID}"])
    cmd = [lm_eval, "run", "--model", "local-completions", "--model_args", args, "--tasks", ",".join(TASKS),
           "--include_path", str(EVAL_DIR), "--output_path", str(out), "--log_samples"]
    if limit:
        cmd += ["--limit", str(limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": os.environ.get("MOEMESH_API_KEY", "")}
    with open(out / "lm_eval.log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise CLIError(f"lm_eval exited with status {code}; see {out / 'lm_eval.log'}")
    (results_file,) = glob.glob(str(out / "*" / "results_*.json"))
    samples = {t: [json.loads(x) for x in open(f)]
               for t in TASKS for f in glob.glob(str(out / "*" / f"samples_{t}_*.jsonl"))}
    return {"results": json.load(open(results_file))["results"], "samples": samples}


def summarize(raw: dict, tokenizer) -> dict:
    """Token perplexity (lm-eval's per-document log-likelihoods over the documents' token counts),
    byte perplexity, bits per byte and next-line exact match."""
    ppl, nextline = raw["results"]["demo_stdlib_ppl"], raw["results"]["demo_stdlib_nextline"]
    docs = raw["samples"]["demo_stdlib_ppl"]
    loglik = sum(_number(s["resps"]) for s in docs)
    tokens = sum(len(tokenizer.encode(s["doc"]["text"], add_special_tokens=False).ids) for s in docs)
    return {"token_ppl": math.exp(-loglik / tokens), "loss": -loglik / tokens, "tokens": tokens,
            "byte_ppl": ppl["byte_perplexity,none"], "bits_per_byte": ppl["bits_per_byte,none"],
            "exact_match": nextline["exact_match,none"], "edit_sim": nextline["edit_sim,none"],
            "items": len(raw["samples"]["demo_stdlib_nextline"])}


def _number(x) -> float:
    """lm-eval's logged response, e.g. "[['-6979.37']]" (a string, or lists of them), as a float."""
    while True:
        if isinstance(x, str):
            x = ast.literal_eval(x)
        if isinstance(x, (list, tuple)):
            x = x[0]
        else:
            return float(x)


# -- the reference: transformers in this process ----------------------------------------------------

def transformers_row(model: Path, limit: int | None) -> dict:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from moemesh.entrypoints.train_demo import heldout_nll

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    docs = [json.loads(x)["text"] for x in open(EVAL_DIR / "heldout.jsonl")][:limit]
    logits = lambda ids: hf(torch.tensor([ids])).logits[0]  # noqa: E731
    nll, tokens, nbytes = heldout_nll(logits, tok, docs, 510)
    items = [json.loads(x) for x in open(EVAL_DIR / "nextline.jsonl")][:limit]
    hits, sim = 0, 0.0
    with torch.no_grad():
        for item in items:
            # as lm-eval does: the prompt left-truncated to leave room for 48 new tokens in 511
            ids = tok.encode(item["prompt"], add_special_tokens=False).ids[-(511 - 48):]
            out = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, eos_token_id=[0, 3],
                              pad_token_id=0)[0, len(ids):]
            line = tok.decode(out.tolist(), skip_special_tokens=True).split("\n")[0].rstrip()
            hits += line == item["target"]
            sim += difflib.SequenceMatcher(None, line, item["target"]).ratio()
    return {"token_ppl": math.exp(nll / tokens), "loss": nll / tokens, "tokens": tokens,
            "byte_ppl": math.exp(nll / nbytes), "bits_per_byte": nll / nbytes / math.log(2),
            "exact_match": hits / len(items), "edit_sim": sim / len(items), "items": len(items)}


# -- the table --------------------------------------------------------------------------------------

def table(rows: list[tuple[str, str, dict]]) -> str:
    lines = ["| weights | pp | token perplexity | byte perplexity | bits/byte | next line: exact match | "
             "next line: edit similarity |", "|---|---|---|---|---|---|---|"]
    for name, pp, r in rows:
        if "error" in r:
            lines.append(f"| {name} | {pp} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {name} | {pp} | {r['token_ppl']:.4f} | {r['byte_ppl']:.4f} | {r['bits_per_byte']:.4f} | "
                     f"{r['exact_match']:.3f} ({round(r['exact_match'] * r['items'])}/{r['items']}) | "
                     f"{r['edit_sim']:.4f} |")
    return "\n".join(lines) + "\n"


def run_eval_demo(args) -> int:
    from tokenizers import Tokenizer

    from moemesh.entrypoints.default_model import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    if not (EVAL_DIR / "heldout.jsonl").is_file():
        raise CLIError(f"no {EVAL_DIR}/heldout.jsonl: eval-demo runs from a clone of the repository")
    if not (model / "tokenizer.json").is_file():
        raise CLIError(f"--model {model}: no tokenizer.json there (not a model directory)")
    wanted = set(args.rows.split(",")) if args.rows else None
    known = {"transformers", *(row.key for row in ROWS)}
    if wanted is not None and wanted - known:
        raise CLIError(f"--rows {args.rows}: {', '.join(sorted(wanted - known))} is not one of "
                       f"{', '.join(sorted(known))}")
    try:
        pps = [int(x) for x in args.pp.split(",")]
    except ValueError:
        pps = []
    if not pps or min(pps) < 1:
        raise CLIError(f"--pp {args.pp}: expected stage counts, e.g. 1,2")
    lm_eval = shutil.which(args.lm_eval) or args.lm_eval
    if not Path(lm_eval).is_file():
        raise CLIError(f"--lm-eval {args.lm_eval}: not found (pip install 'moemesh[eval]', or give its path)")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="moemesh-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    results: list[tuple[str, str, dict]] = []

    def emit(name: str, pp: str, r: dict, seconds: float) -> None:
        results.append((name, pp, r))
        print(f"row={name!r} pp={pp} token_ppl={r['token_ppl']:.4f} byte_ppl={r['byte_ppl']:.4f} "
              f"exact_match={r['exact_match']:.3f} edit_sim={r['edit_sim']:.4f} seconds={seconds:.0f}", flush=True)

    if wanted is None or "transformers" in wanted:
        t0 = time.perf_counter()
        emit("transformers (reference)", "-", transformers_row(model, args.limit), time.perf_counter() - t0)
    for row in ROWS:
        if wanted is not None and row.key not in wanted:
            continue
        served = model
        if row.autofp8:
            from moemesh.entrypoints.quantize import quantize_checkpoint

            served = work / "demo-fp8"
            if not (served / "config.json").is_file():  # (config.json is written last: a run cut short before it
                shutil.rmtree(served, ignore_errors=True)  # left shards that a new quantize would refuse)
                quantize_checkpoint(model, served, progress=False)
        for pp in pps:
            t0 = time.perf_counter()
            out = work / f"{row.key}-pp{pp}"
            out.mkdir(parents=True, exist_ok=True)
            port = free_port()
            try:
                proc = serve(served, pp, row.serve_flags, port, out / "serve.log")
                try:
                    raw = run_lm_eval(lm_eval, served, port, out, args.limit, args.concurrency)
                finally:
                    stop(proc)
            except CLIError as e:  # the row says so, and the others still run
                print(f"row={row.name!r} pp={pp} failed: {e}", flush=True)
                results.append((row.name, str(pp), {"error": str(e)}))
                continue
            emit(row.name, str(pp), summarize(raw, tokenizer), time.perf_counter() - t0)

    text = table(results)
    print(text)
    (work / "results.json").write_text(json.dumps([{"row": n, "pp": p, **r} for n, p, r in results], indent=1))
    if args.out:
        Path(args.out).write_text(text)
    failed = [f"{name} (pp={pp})" for name, pp, r in results if "error" in r]
    if failed:  # (the table has the rows that ran; the command says that some did not)
        raise CLIError(f"{len(failed)} of {len(results)} rows failed: {', '.join(failed)}; their logs are in {work}")
    return 0
