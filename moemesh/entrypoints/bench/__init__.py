"""The `moemesh bench ...` commands."""

from __future__ import annotations

import tempfile
from pathlib import Path

from moemesh.errors import CLIError


def check_writable(flag: str, value: str, directory: Path, make: bool = False) -> None:
    """A benchmark's output directory, written only after its runs, is refused before them when a
    file cannot be made in it (naming the flag and its value). make: create the directory first."""
    try:
        if make:
            directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise CLIError(f"{flag} {value}: {e.strerror or e}") from None
