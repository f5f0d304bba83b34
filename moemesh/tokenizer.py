"""Text <-> token ids with the checkpoint's own tokenizer.json (the `tokenizers` library; no
transformers at run time), plus what tokenizer_config.json says about special tokens."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from moemesh.config import read_json_object
from moemesh.errors import ConfigError


class TextTokenizer:
    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # (tokenizers raises a bare Exception for a file it cannot read)
            raise ConfigError(f"{path} is not a tokenizer the tokenizers library can read: {e}") from None
        config_path = d / "tokenizer_config.json"
        self.config = read_json_object(config_path) if config_path.is_file() else {}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def special_token(self, name: str) -> str | None:
        """bos_token / eos_token / pad_token / unk_token as text, from tokenizer_config.json."""
        token = self.config.get(name)
        return token.get("content") if isinstance(token, dict) else token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """With add_special_tokens, whatever the tokenizer's post-processor adds (e.g. a BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=skip_special_tokens)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (those a decode with skip_special_tokens leaves out)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def longest_token_chars(self) -> int:
        """The most characters any one token decodes to (at most its vocabulary entry's length: a
        byte-level entry has a symbol per byte)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def token_text(self, token_id: int) -> str:
        """One token as text, as it reads inside a text (its bytes decoded; a partial character shows as
        U+FFFD): decoded after an ordinary token, since SentencePiece-style decoders (Llama, Mistral)
        strip the leading space of a decode's first token ("▁Paris" alone decodes to "Paris")."""
        anchor, anchor_text = self._anchor
        if anchor is not None:
            text = self.decode([anchor, token_id], skip_special_tokens=False)
            if text.startswith(anchor_text):
                return text[len(anchor_text):]
        return self.decode([token_id], skip_special_tokens=False)

    @cached_property
    def _anchor(self) -> tuple[int | None, str]:
        """An ordinary token that decodes to whole characters of its own (none: decode alone)."""
        for ids in (self._tok.encode("a", add_special_tokens=False).ids, range(min(self.vocab_size, 512))):
            for i in ids:
                text = self.decode([i], skip_special_tokens=False)
                if i not in self.special_ids and text.strip() and "\ufffd" not in text:
                    return i, text
        return None, ""
