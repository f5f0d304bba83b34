"""Text <-> token ids with the checkpoint's own tokenizer.json (the `tokenizers` library; no
transformers at run time), plus what tokenizer_config.json says about special tokens."""

from __future__ import annotations

import codecs
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from moemesh.config import read_json_object
from moemesh.errors import ConfigError


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): a printable character for each byte, the byte itself
    where it is printable Latin-1, else 256 + its rank among the others."""
    kept = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = {}, 0
    for b in range(256):
        if b in kept:
            out[chr(b)] = b
        else:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


_BYTE_OF = _byte_alphabet()


def whole_characters(data: bytes) -> tuple[int, bytes]:
    """UTF-8 bytes -> (the characters they hold whole, each run of bytes that cannot begin or continue
    one counted as a U+FFFD, as a decode shows it; the bytes after them that begin a character not
    yet whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    return len(decoder.decode(data)), decoder.getstate()[0]


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

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes as it reads inside a text: a byte-level vocabulary's entry (GPT-2, Llama 3,
        Qwen) mapped back through its byte alphabet, a SentencePiece byte-fallback entry (<0xNN>) its
        byte; else its text in UTF-8 (a special token's, an ordinary SentencePiece piece's)."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added_ids:
            if self.byte_level:  # (where "<0x41>" would be six bytes of text)
                if all(c in _BYTE_OF for c in piece):
                    return bytes(_BYTE_OF[c] for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self.token_text(token_id).encode()

    def token_label(self, token_id: int) -> str:
        """A token as logprobs name it (OpenAI's way): its text, or where its bytes are not whole
        characters (a character split across tokens), "bytes:" and the bytes as \\xNN escapes."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def whole_text(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The tokens' decode up to the character they end inside of, if they do: a byte-level
        decode's one U+FFFD for it left out, or with byte fallback the decode of the tokens before it."""
        if not self.ends_inside_character(ids, skip_special_tokens):
            return self.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.byte_level:
            return self.decode(ids, skip_special_tokens=skip_special_tokens)[:-1]
        return self.decode(ids[:self.whole_prefix(ids, skip_special_tokens=skip_special_tokens)],
                           skip_special_tokens=skip_special_tokens)

    def ends_inside_character(self, ids: list[int], skip_special_tokens: bool = False) -> bool:
        """Whether the tokens' bytes end inside a character: its first bytes there, the rest to come
        (not a U+FFFD the text holds, nor an invalid byte, which stay what they are). With
        `skip_special_tokens`, special tokens have no bytes (a decode that skips them joins the bytes
        on either side into one character)."""
        tail = self._tail(ids, len(ids), skip_special_tokens)
        return bool(whole_characters(b"".join(self.token_bytes(ids[i]) for i in tail))[1])

    def _tail(self, ids: list[int], end: int, skip_special_tokens: bool) -> list[int]:
        """Indices of the last 4 tokens before `end` with bytes in a decode (a character's bytes span at
        most 4 tokens; with `skip_special_tokens`, special tokens have none)."""
        if not skip_special_tokens:
            return list(range(max(0, end - 4), end))
        special = self.special_ids
        return [i for i in range(max(0, end - 16), end) if ids[i] not in special][-4:]

    def whole_prefix(self, ids: list[int], end: int | None = None, skip_special_tokens: bool = False) -> int:
        """The largest b <= end (default: all of them) where ids[:b] ends before the token a character
        not yet whole begins in, told by the bytes (a decode's U+FFFD cannot tell: a byte-fallback
        decoder turns every byte of a run of <0xNN> pieces into one when any of them is not whole). A
        character's bytes span at most 4 tokens (with `skip_special_tokens`, special tokens among them
        have no bytes). (A byte-level token may hold whole characters before the first bytes of the
        next: those are left out too; `whole_text` keeps them.)"""
        end = len(ids) if end is None else end
        tail = self._tail(ids, end, skip_special_tokens)
        pieces = [self.token_bytes(ids[i]) for i in tail]
        b, inside = end, len(whole_characters(b"".join(pieces))[1])  # (the bytes of the character begun)
        for i, piece in zip(reversed(tail), reversed(pieces)):  # back to the token its first byte is in
            if inside <= 0:
                break
            inside -= len(piece)
            b = i
        return b

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @cached_property
    def byte_level(self) -> bool:
        """Whether the decoder maps a byte alphabet back to bytes (a ByteLevel decoder, alone or in a
        sequence)."""
        import json

        decoder = self._tok.decoder  # (its own JSON: the whole tokenizer's is megabytes to parse)
        decoder = json.loads(decoder.__getstate__()) if decoder is not None else {}
        parts = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]
        return any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)

    @cached_property
    def _anchor(self) -> tuple[int | None, str]:
        """An ordinary token that decodes to whole characters of its own (none: decode alone)."""
        for ids in (self._tok.encode("a", add_special_tokens=False).ids, range(min(self.vocab_size, 512))):
            for i in ids:
                text = self.decode([i], skip_special_tokens=False)
                if i not in self.special_ids and text.strip() and "\ufffd" not in text:
                    return i, text
        return None, ""
