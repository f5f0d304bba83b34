"""The demo model's lm-eval tasks (demo_stdlib_ppl.yaml, demo_stdlib_nextline.yaml): data from the JSONL
files beside this one, written by `moemesh train-demo --write-eval-data eval/demo`; nothing from a hub."""

import difflib
import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def heldout(**kwargs) -> datasets.DatasetDict:
    """One held-out standard-library file per row: path, text."""
    return _load("heldout.jsonl")


def nextline(**kwargs) -> datasets.DatasetDict:
    """One line of a held-out function per row: path, line, prompt (the lines before it), target."""
    return _load("nextline.jsonl")


def next_line_match(doc: dict, results: list[str]) -> dict:
    """Greedy generation stopped at the first newline, against the line, trailing spaces aside: exact
    match, and edit similarity (difflib's ratio, 0..1; CodeXGLUE's line completion reports both)."""
    line = results[0].split("\n")[0].rstrip()
    return {"exact_match": float(line == doc["target"]),
            "edit_sim": difflib.SequenceMatcher(None, line, doc["target"]).ratio()}
