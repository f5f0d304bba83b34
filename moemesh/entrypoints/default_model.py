"""The built-in default model: the demo Mixtral (8 experts, top-2, 12M parameters) trained on the
Python standard library by `moemesh train-demo`, shipped in the package as moemesh/demo_model.

It completes Python code; its held-out perplexity and the accuracy of each quantization and layout
are in docs/accuracy.md. Tests that want random weights of a chosen shape write them with
`tiny_model.write_tiny_model`.
"""

from __future__ import annotations

from pathlib import Path

from moemesh.errors import ConfigError

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "demo_model"


def default_model_dir() -> Path:
    if not (DEMO_MODEL_DIR / "model.safetensors").is_file():
        raise ConfigError(f"the built-in model is missing from {DEMO_MODEL_DIR} (an install without the "
                          "package data?); give --model DIR, or write it with moemesh train-demo --out "
                          f"{DEMO_MODEL_DIR}")
    return DEMO_MODEL_DIR
