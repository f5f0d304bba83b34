"""The built-in default model: a small random Mixtral written by make-tiny-model on first use
(until a trained demo model exists), kept under $MOEMESH_HOME (default ~/.cache/moemesh)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from moemesh.entrypoints.tiny_model import DEFAULT_SPEC, write_tiny_model


def default_model_dir() -> Path:
    home = Path(os.environ.get("MOEMESH_HOME", Path.home() / ".cache" / "moemesh"))
    target = home / "models" / "default-tiny-mixtral"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".writing-"))
        try:
            write_tiny_model(DEFAULT_SPEC, tmp)
            tmp.rename(target)  # atomic: a concurrent writer either wins or finds it complete
        except OSError:
            if not (target / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
