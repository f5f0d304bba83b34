"""Text <-> token ids with the checkpoint's own tokenizer.json (the `tokenizers` library; no
transformers at run time)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = Tokenizer.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """The tokenizer's own special-token handling (e.g. a BOS its post-processor adds)."""
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)
