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
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from moemesh.entrypoints.signals import stop_on_hangup
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
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        deadline = time.monotonic() + 600
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith("moemesh is serving"):
                    return proc
                if time.monotonic() > deadline:
                    break
        except BaseException:  # (Ctrl-C, SIGTERM: the server stops with this command)
            stop(proc)
            raise
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
    """lm-eval's results and samples for TASKS against the server on `port`, from the files it writes
    under `out` (a folder of this run's alone: one results file)."""
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
        # (a process group of its own, stopped whole if this command is: no lm_eval left behind)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code != 0:
        raise CLIError(f"lm_eval exited with status {code}; see {out / 'lm_eval.log'}")
    results_files = glob.glob(str(out / "*" / "results_*.json"))
    if len(results_files) != 1:
        raise CLIError(f"lm_eval wrote {len(results_files)} results files under {out}, not one; see "
                       f"{out / 'lm_eval.log'}")
    (results_file,) = results_files
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


# -- a row's run ------------------------------------------------------------------------------------

QUANTIZED_FROM = "quantized_from.json"  # in the AutoFP8 copy: the checkpoint it was made from


def checkpoint_identity(model: Path) -> dict:
    """What tells a checkpoint from another cheaply: its resolved path, its config.json, and the size
    and modification time of each of its files (rewritten weights change them)."""
    model = model.resolve()
    return {"model": str(model), "config": json.loads((model / "config.json").read_text()),
            "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(model.iterdir())
                      if p.is_file()}}


def autofp8_checkpoint(model: Path, work: Path) -> Path:
    """The AutoFP8 copy of `model` that `moemesh quantize` writes, in work/demo-fp8: the one there if
    it was made from this checkpoint as it is now, else made again."""
    from moemesh.entrypoints.quantize import quantize_checkpoint

    served, source = work / "demo-fp8", checkpoint_identity(model)
    try:  # (config.json is written last, and the record after it: a copy cut short has neither)
        if (served / "config.json").is_file() and json.loads((served / QUANTIZED_FROM).read_text()) == source:
            return served
    except (OSError, ValueError):
        pass
    shutil.rmtree(served, ignore_errors=True)  # (a copy cut short left shards that a new quantize would refuse)
    quantize_checkpoint(model, served, progress=False)
    (served / QUANTIZED_FROM).write_text(json.dumps(source, indent=1))
    return served


def api_row(lm_eval: str, served: Path, pp: int, flags: tuple[str, ...], out: Path, args, tokenizer) -> dict:
    """One row at one --pp through the API: `moemesh serve`, lm-eval against it, the server stopped;
    their logs and output in `out`, emptied first (lm-eval adds files to what is there)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    port = free_port()
    proc = serve(served, pp, flags, port, out / "serve.log")
    try:
        raw = run_lm_eval(lm_eval, served, port, out, args.limit, args.concurrency)
    finally:
        stop(proc)
    return summarize(raw, tokenizer)


def failure(e: Exception, log: Path) -> str:
    """What the table says of a row that failed: a CLIError's message, or an unexpected error's, with
    its traceback written to `log`."""
    if isinstance(e, CLIError):
        return str(e)
    message = f"{type(e).__name__}: {e}"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(e)))
    except OSError:
        return message
    return f"{message} (see {log})"


# -- the table --------------------------------------------------------------------------------------

def table(rows: list[tuple[str, str, dict]]) -> str:
    lines = ["| weights | pp | token perplexity | byte perplexity | bits/byte | next line: exact match | "
             "next line: edit similarity |", "|---|---|---|---|---|---|---|"]
    for name, pp, r in rows:
        if "error" in r:
            error = " ".join(r["error"].split()).replace("|", "\\|")  # (one line, in its cell)
            lines.append(f"| {name} | {pp} | failed: {error} | | | | |")
            continue
        lines.append(f"| {name} | {pp} | {r['token_ppl']:.4f} | {r['byte_ppl']:.4f} | {r['bits_per_byte']:.4f} | "
                     f"{r['exact_match']:.3f} ({round(r['exact_match'] * r['items'])}/{r['items']}) | "
                     f"{r['edit_sim']:.4f} |")
    return "\n".join(lines) + "\n"


def run_eval_demo(args) -> int:
    from tokenizers import Tokenizer

    from moemesh.config import ModelConfig
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
    layers = ModelConfig.from_dir(model).num_layers
    if max(pps) > layers:  # (each row's server would refuse it, said only in its log)
        raise CLIError(f"--pp {args.pp}: {max(pps)} stages, more than the model's {layers} layers (--model {model})")
    lm_eval = shutil.which(args.lm_eval) or args.lm_eval
    if not Path(lm_eval).is_file():
        raise CLIError(f"--lm-eval {args.lm_eval}: not found (pip install 'moemesh[eval]', or give its path)")
    if args.out is not None:  # (before the rows, not after them)
        table_path = Path(args.out)
        if table_path.is_dir():
            raise CLIError(f"--out {args.out}: a directory (the table is written to a file)")
        if not table_path.parent.is_dir():
            raise CLIError(f"--out {args.out}: no directory {table_path.parent}")
        if not os.access(table_path.parent, os.W_OK | os.X_OK) or \
                (table_path.exists() and not os.access(table_path, os.W_OK)):
            raise CLIError(f"--out {args.out}: not writable")
    if args.work_dir is not None:
        work = Path(args.work_dir)
        if work.exists() and not work.is_dir():
            raise CLIError(f"--work-dir {args.work_dir}: not a directory")
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--work-dir {args.work_dir}: {e.strerror or e}") from None
        if not os.access(work, os.W_OK | os.X_OK):
            raise CLIError(f"--work-dir {args.work_dir}: not writable")
    else:
        work = Path(tempfile.mkdtemp(prefix="moemesh-eval-"))
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    results: list[tuple[str, str, dict]] = []

    def measure(name: str, pp: str, log: Path, fn) -> None:
        """Runs one row's fn; its result, or its failure (an unexpected error's traceback in `log`),
        goes to the table and the others still run."""
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:
            failed(name, pp, failure(e, log))
            return
        results.append((name, pp, r))
        print(f"row={name!r} pp={pp} token_ppl={r['token_ppl']:.4f} byte_ppl={r['byte_ppl']:.4f} "
              f"exact_match={r['exact_match']:.3f} edit_sim={r['edit_sim']:.4f} "
              f"seconds={time.perf_counter() - t0:.0f}", flush=True)

    def failed(name: str, pp: str, message: str) -> None:
        print(f"row={name!r} pp={pp} failed: {message}", flush=True)
        results.append((name, pp, {"error": message}))

    with stop_on_hangup():
        if wanted is None or "transformers" in wanted:
            measure("transformers (reference)", "-", work / "transformers.error.log",
                    lambda: transformers_row(model, args.limit))
        runs: dict[str, int] = {}  # a row's folder -> its runs so far (--pp 1,1 runs pp=1 twice)
        for row in ROWS:
            if wanted is not None and row.key not in wanted:
                continue
            try:
                served = autofp8_checkpoint(model, work) if row.autofp8 else model
            except Exception as e:  # (every pp of the row fails with it)
                message = failure(e, work / "demo-fp8.error.log")
                for pp in pps:
                    failed(row.name, str(pp), message)
                continue
            for pp in pps:
                key = f"{row.key}-pp{pp}"
                runs[key] = runs.get(key, 0) + 1
                out = work / (key if runs[key] == 1 else f"{key}-run{runs[key]}")
                measure(row.name, str(pp), out / "error.log",
                        lambda: api_row(lm_eval, served, pp, row.serve_flags, out, args, tokenizer))

    text = table(results)
    print(text)
    (work / "results.json").write_text(json.dumps([{"row": n, "pp": p, **r} for n, p, r in results], indent=1))
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as e:
            raise CLIError(f"--out {args.out}: {e.strerror or e}") from None
    failed_rows = [f"{name} (pp={pp})" for name, pp, r in results if "error" in r]
    if failed_rows:  # (the table has the rows that ran; the command says that some did not)
        raise CLIError(f"{len(failed_rows)} of {len(results)} rows failed: {', '.join(failed_rows)}; their logs are "
                       f"in {work}")
    return 0
