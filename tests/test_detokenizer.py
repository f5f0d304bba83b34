"""gateway.detokenizer.IncrementalDetokenizer with the tiny model's byte-level BPE tokenizer: streamed
pieces add up to the full decode, no broken UTF-8 character leaks, stop strings are found across token
boundaries and cut, and text that only looks like the start of a stop string is held, then released."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from gateway.detokenizer import IncrementalDetokenizer
from moemesh.entrypoints.tiny_model import TinyModelSpec, write_tiny_model
from moemesh.tokenizer import TextTokenizer, whole_characters

SPEC = TinyModelSpec(arch="mixtral", num_layers=1, hidden_size=32, intermediate_size=32, num_heads=2,
                     num_kv_heads=1, num_experts=2, top_k=1, vocab_size=600)

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "accents": "Café crème brûlée, naïve façade, Ångström, Straße, e\u0301 (combining)",
    "cjk": "日本語のテキストと中文字符，한국어 문장。",
    "emoji": "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🎉!",
    "mixed": "Paris → 東京 ≈ 9 712 km 🚄 (ça va?) done",
    "whitespace": "  leading\n\n\ttabs   and    runs   \n\n   trailing   ",
    "special_tokens": "<|im_start|>user\nhi é<|im_end|>\n<|im_start|>assistant\n日本<|im_end|><|endoftext|>",
    "code": "def add(a, b):\n    return a + b\n\nprint(json.dumps({\"k\": [1, 2]}))\n",
    "literal_replacement_char": "a\ufffdb and \ufffd\ufffd then ok",
    "empty": "",
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(SPEC, tmp_path_factory.mktemp("detok") / "tiny")


@pytest.fixture(scope="module")
def tok(model_dir):
    return TextTokenizer(model_dir)


@pytest.fixture(scope="module")
def byte_id(model_dir):
    """Token id of the single-byte token for byte b (the byte-level alphabet is in every vocab)."""
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    table = _bytes_to_unicode()
    return lambda b: raw.token_to_id(table[b])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _chunkings(n_ids: int, seeds=range(6)):
    """One token at a time, everything at once, then seeded random chunk sizes 1..5 (0 included)."""
    yield [1] * n_ids
    yield [n_ids]
    for seed in seeds:
        rng = random.Random(seed)
        sizes, left = [], n_ids
        while left > 0:
            k = min(left, rng.choice([0, 1, 1, 2, 3, 4, 5]))
            sizes.append(k)
            left -= k
        yield sizes


def _stream(tok, ids, sizes, stop=(), context=()):
    """Feeds ids in chunks of `sizes`; returns the detokenizer, the pieces from add, and finish()'s piece."""
    d = IncrementalDetokenizer(tok, list(stop), context=context)
    pieces, i = [], 0
    for k in sizes:
        pieces.append(d.add(ids[i:i + k]))
        i += k
    assert i == len(ids)
    return d, pieces, d.finish()


# --- pieces add up, no broken character leaks ---------------------------------------------------------------

def test_multibyte_characters_really_are_split_across_tokens(tok):
    """Precondition for the tests below: the small vocab splits CJK and emoji into byte tokens."""
    for key in ("cjk", "emoji", "accents"):
        ids = tok.encode(TEXTS[key])
        assert any("\ufffd" in tok.token_text(i) for i in ids), key


@pytest.mark.parametrize("key", list(TEXTS))
def test_pieces_add_up_to_the_full_decode(tok, key):
    ids = tok.encode(TEXTS[key])
    full = tok.decode(ids)
    if key != "special_tokens":
        assert full == TEXTS[key]  # byte-level BPE round-trips
    else:
        assert "<|im_end|>" not in full and "日本" in full  # special tokens are skipped in the decode
    for sizes in _chunkings(len(ids)):
        d, pieces, last = _stream(tok, ids, sizes)
        assert "".join(pieces) + last == full, sizes
        assert d.text == full and not d.stopped
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces + [last]), (sizes, pieces)
        if not full.endswith("\ufffd"):  # complete text: nothing held back for finish()
            assert last == "", (sizes, last)


@pytest.mark.parametrize("key", ["cjk", "emoji", "accents"])
def test_every_streamed_prefix_is_whole_characters(tok, key):
    """After each add, what was shown so far is a prefix of the text made of whole characters, and as
    soon as a character's last byte arrives it is shown (nothing is held longer than needed)."""
    text = TEXTS[key]
    assert "\ufffd" not in text
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [])
    shown = ""
    for n in range(1, len(ids) + 1):
        shown += d.add(ids[n - 1:n])
        assert text.startswith(shown)
        decoded = tok.decode(ids[:n])  # ends in U+FFFD while a character is incomplete
        assert shown == decoded.rstrip("\ufffd"), (n, shown, decoded)


@pytest.mark.parametrize("name,byte_seq", [
    ("lone continuation byte in the middle", b"ab\x80cd"),
    ("lone continuation byte at the end", b"ab\x80"),
    ("truncated 3-byte character at the end", "x日".encode()[:-1]),
    ("truncated 3-byte character then ascii", "日".encode()[:-1] + b"xyz"),
    ("invalid bytes 0xff 0xfe", b"a\xff\xfeb"),
    ("overlong encoding", b"a\xc0\x80b"),
    ("only continuation bytes", b"\x80\x81\x82"),
])
def test_invalid_byte_sequences_still_end_in_the_full_decode(tok, byte_id, name, byte_seq):
    ids = [byte_id(b) for b in byte_seq]
    assert all(i is not None for i in ids)
    full = tok.decode(ids)
    assert "\ufffd" in full  # genuinely invalid UTF-8
    for sizes in _chunkings(len(ids)):
        d, pieces, last = _stream(tok, ids, sizes)
        assert "".join(pieces) + last == full, (name, sizes)
        assert d.text == full
        if not full.endswith("\ufffd"):  # valid text after the bad bytes is released before finish()
            assert last == "", (name, sizes)


def test_invalid_byte_then_text_does_not_stall_the_stream(tok, byte_id):
    ids = tok.encode("ok ") + [byte_id(0x80)] + tok.encode(" The capital of France")
    d = IncrementalDetokenizer(tok, [])
    shown = "".join(d.add([i]) for i in ids)
    assert shown == tok.decode(ids) == "ok \ufffd The capital of France"
    assert d.finish() == ""


def test_invalid_bytes_are_released_as_they_come_not_held_and_decoded_again(tok, byte_id):
    """A stream of invalid bytes (a lone continuation byte, allowed_token_ids can force one) shows each
    U+FFFD at once: the window moves on, so a token costs the same however many came before (held, the
    whole tail was decoded again for every token). A character's first bytes are still held."""
    d = IncrementalDetokenizer(tok, [])
    for k in range(2000):
        assert d.add([byte_id(0xA5)]) == "\ufffd", k
        assert d.read_offset - d.prefix_offset <= 1
    first = "日".encode()
    assert d.add([byte_id(first[0])]) == "" and d.add([byte_id(first[1])]) == ""
    assert d.add([byte_id(first[2])]) == "日"
    rng = random.Random(0)  # and random bytes, valid or not, in random chunks, add up to the full decode
    for _ in range(30):
        data = bytes(rng.choice([0x41, 0x80, 0xA5, 0xC3, 0xA9, 0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0xFF])
                     for _ in range(rng.randrange(1, 40)))
        ids = [byte_id(b) for b in data]
        for sizes in _chunkings(len(ids), seeds=range(3)):
            d, pieces, last = _stream(tok, ids, sizes)
            assert "".join(pieces) + last == tok.decode(ids), (data, sizes)


# --- stop strings -----------------------------------------------------------------------------------------

SENTENCE = "The capital of France is Paris. The capital of Japan is Tokyo."


def _boundaries(tok, ids) -> set[int]:
    """Character offsets at which a token ends (ASCII text: one byte per character)."""
    return {len(tok.decode(ids[:n])) for n in range(1, len(ids) + 1)}


def _check_stop(tok, text, stop, expected):
    ids = tok.encode(text)
    for sizes in _chunkings(len(ids)):
        d = IncrementalDetokenizer(tok, list(stop))
        shown, i = "", 0
        for k in sizes:
            shown += d.add(ids[i:i + k])
            i += k
            assert expected.startswith(shown), (sizes, shown)  # never anything at or after the stop string
        shown += d.finish()
        assert shown == expected and d.text == expected, (sizes, shown, d.text)
        assert d.stopped
        assert d.add(tok.encode(" more text")) == "" and d.finish() == ""  # nothing after the stop
        assert d.text == expected


def test_stop_string_spanning_token_boundaries_is_found_and_cut(tok):
    stop = "France is Par"
    start = SENTENCE.index(stop)
    ids = tok.encode(SENTENCE)
    inner = {b for b in _boundaries(tok, ids) if start < b < start + len(stop)}
    assert len(inner) >= 2  # the stop string spans at least three tokens
    _check_stop(tok, SENTENCE, [stop], SENTENCE[:start])


def test_stop_string_inside_one_token_is_cut_mid_token(tok):
    ids = tok.encode(SENTENCE)
    assert " capital" in [tok.token_text(i) for i in ids]
    _check_stop(tok, SENTENCE, ["apit"], "The c")


def test_stop_string_cuts_at_its_first_occurrence(tok):
    _check_stop(tok, SENTENCE, ["capital"], "The ")
    _check_stop(tok, SENTENCE, [" is "], "The capital of France")


def test_stop_string_across_multibyte_characters(tok):
    text = "Paris → 東京 ≈ 9 712 km"
    _check_stop(tok, text, ["東京"], "Paris → ")
    _check_stop(tok, text, ["京 ≈"], "Paris → 東")


@pytest.mark.parametrize("stop", [["Paris", "capital"], ["capital", "Paris"]])
def test_earliest_of_several_stop_strings_wins(tok, stop):
    _check_stop(tok, SENTENCE, stop, "The ")


@pytest.mark.parametrize("stop", [["of France", "capital of"], ["capital of", "of France"]])
def test_earliest_occurrence_wins_when_both_arrive_in_one_chunk(tok, stop):
    ids = tok.encode(SENTENCE)
    d = IncrementalDetokenizer(tok, stop)
    shown = d.add(ids) + d.finish()
    assert shown == d.text == "The " and d.stopped


def test_stop_string_at_the_very_beginning_gives_empty_text(tok):
    _check_stop(tok, SENTENCE, ["The capital"], "")
    _check_stop(tok, SENTENCE, ["T"], "")


def test_empty_stop_strings_are_ignored(tok):
    ids = tok.encode(SENTENCE)
    for stop in ([""], ["", ""], ["", "Tokyo"]):
        for sizes in _chunkings(len(ids)):
            d, pieces, last = _stream(tok, ids, sizes, stop)
            expected = SENTENCE[:SENTENCE.index("Tokyo")] if "Tokyo" in stop else SENTENCE
            assert "".join(pieces) + last == d.text == expected, (stop, sizes)
            assert d.stopped == ("Tokyo" in stop)


def test_look_alike_of_a_stop_string_is_held_then_released_by_a_later_add(tok):
    """"France is Paris" starts like the stop string "France is Lyon": it is held back while it could still
    become the stop string, and released once it cannot."""
    stop = "France is Lyon"
    ids = tok.encode(SENTENCE)
    d = IncrementalDetokenizer(tok, [stop])
    shown, held_at = "", []
    for n in range(1, len(ids) + 1):
        shown += d.add(ids[n - 1:n])
        decoded = tok.decode(ids[:n])
        assert decoded.startswith(shown)
        if decoded.endswith("France is"):
            held_at.append(n)
            assert shown == decoded[:-len("France is")]  # the ambiguous tail is not shown yet
    assert held_at  # the sentence has a token boundary right after "France is"
    assert shown == SENTENCE  # released by later adds, before finish()
    assert d.finish() == "" and d.text == SENTENCE and not d.stopped


def test_look_alike_at_the_end_is_released_by_finish(tok):
    text = "The capital of France is"
    ids = tok.encode(text)
    for sizes in _chunkings(len(ids)):
        d, pieces, last = _stream(tok, ids, sizes, ["France is Lyon", "s Paris"])
        assert "".join(pieces) == "The capital of ", sizes
        assert last == "France is"
        assert d.text == text and not d.stopped


def test_look_alike_that_becomes_the_stop_string_is_never_shown(tok):
    text = "The capital of France is Lyon, not Paris."
    _check_stop(tok, text, ["France is Lyon"], "The capital of ")


@pytest.mark.parametrize("stop", [
    ["France is Paris", "is Lyon"],
    ["is Lyon", "France is Paris"],
])
def test_shown_text_is_always_a_prefix_of_the_final_text_whatever_the_stop_order(tok, stop):
    _check_stop(tok, SENTENCE, stop, "The capital of ")


def test_no_stop_string_ends_the_text_before_min_tokens(tok):
    """min_tokens holds for stop strings as for stop tokens (as vLLM): a stop string inside the first
    min_tokens tokens does not end the text; one after them does."""
    text = "one two one two one two"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, ["two"], min_tokens=len(tok.encode("one two one")))
    shown = "".join(d.add([i]) for i in ids) + d.finish()
    assert d.stopped and shown == "one two one "
    d = IncrementalDetokenizer(tok, ["two"])
    assert "".join(d.add([i]) for i in ids) == "one " and d.stopped


def test_a_stop_string_across_the_min_tokens_boundary_never_takes_back_shown_text(tok):
    """Shown text is always a prefix of the final text, min_tokens or not."""
    text = "x = foo(bar) and foo(baz)"
    ids = tok.encode(text)
    for min_tokens in range(len(ids) + 1):
        d = IncrementalDetokenizer(tok, ["foo("], min_tokens=min_tokens)
        shown = ""
        for i in ids:
            shown += d.add([i])
            assert d.text.startswith(shown), (min_tokens, shown, d.text)
        shown += d.finish()
        assert shown == d.text
        if min_tokens <= 1:
            assert d.stopped and d.text == "x = "


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A Llama/Mistral-style tokenizer: "▁" for spaces, byte fallback, and a decoder that strips the
    leading space of whatever a decode starts with."""
    from tokenizers import decoders, models, normalizers, trainers

    raw = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    raw.train_from_iterator([TEXTS["ascii"] + " Paris. Hello world, " + TEXTS["accents"]] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    d = tmp_path_factory.mktemp("sp")
    raw.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def sentencepiece_tok(sentencepiece_dir):
    return TextTokenizer(sentencepiece_dir)


@pytest.fixture(scope="module")
def byte_fallback_tok(sentencepiece_dir, tmp_path_factory):
    """The same, with its <0xNN> pieces in the model's vocabulary (not added tokens), as Llama's,
    Mistral's and Mixtral's tokenizer.json have them: text it has no pieces for (CJK) is all bytes,
    and ByteFallback turns every byte of a run into a U+FFFD when any byte of the run is not whole."""
    import json

    src = json.loads((sentencepiece_dir / "tokenizer.json").read_text())
    src["added_tokens"] = [a for a in src["added_tokens"] if not a["content"].startswith("<0x")]
    d = tmp_path_factory.mktemp("sp-bytes")
    (d / "tokenizer.json").write_text(json.dumps(src))
    return TextTokenizer(d)


def _whole_chars_before(tok, ids, cut) -> int:
    """The largest c <= cut where ids[:c]'s bytes are whole UTF-8 (a strict decode: the oracle)."""
    for c in range(cut, -1, -1):
        try:
            b"".join(tok.token_bytes(i) for i in ids[:c]).decode("utf-8")
            return c
        except UnicodeDecodeError:
            continue
    return 0


@pytest.mark.parametrize("text", [TEXTS["cjk"], "Say: 你好世界我们今天很好", TEXTS["emoji"], TEXTS["mixed"]])
def test_a_byte_fallback_vocabulary_streams_whole_characters_after_any_prompt(byte_fallback_tok, text):
    """Cut anywhere, at a character or inside one (a token-id prompt), the output is vLLM's text:
    decode(prompt + output) less the decode of the prompt's whole characters. The first window and a
    cut character are found by the bytes: a decode of byte pieces that ends inside a character is
    U+FFFD for all of the run (it had shown '���文字符' for '中文字符', prompt text among them)."""
    tok = byte_fallback_tok
    ids = tok.encode(text, add_special_tokens=False)
    assert sum(tok.token_label(i).startswith("bytes:") for i in ids) >= 8  # (the case: byte pieces)
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        whole = _whole_chars_before(tok, ids, cut)
        want = tok.decode(ids)[len(tok.decode(ids[:whole])):]
        assert tok.whole_prefix(prompt) == whole, cut
        for sizes in ([1] * len(out), [len(out)]):
            d, pieces, last = _stream(tok, out, sizes, context=prompt)
            assert "".join(pieces) + last == want, (cut, sizes)
        if whole < cut:  # nothing generated after a prompt cut inside a character: no text (vLLM's too)
            assert IncrementalDetokenizer(tok, context=prompt).finish() == ""
            if _whole_chars_before(tok, ids, cut + 1) == whole:  # a generated byte that leaves it cut: one U+FFFD
                d = IncrementalDetokenizer(tok, context=prompt)
                assert d.add(ids[cut:cut + 1]) + d.finish() == "\ufffd"


@pytest.fixture(scope="module")
def mixed_byte_level_tok(tmp_path_factory):
    """A byte-level BPE (GPT-2, Qwen) trained on CJK pairs: its tokens hold a space and the first bytes of
    a character (' \xe4\xb8'), whole characters and the first bytes of the next in one token."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 400)]
    corpus = [" ".join("".join(rng.choice(chars) for _ in range(2)) for _ in range(50)) + " abc def"
              for _ in range(200)]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    raw.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("byte-level")
    raw.save(str(d / "tokenizer.json"))
    return TextTokenizer(d)


def test_a_token_with_whole_characters_and_a_cut_one_keeps_its_whole_characters(mixed_byte_level_tok):
    """A prompt cut in such a token leaves its whole characters to the prompt (the space came back in
    the answer); an output cut in one keeps them, the cut character one U+FFFD (the space had gone)."""
    import codecs

    tok = mixed_byte_level_tok
    ids = tok.encode("x 中文 ab 一丁 七", add_special_tokens=False)
    data = [tok.token_bytes(i) for i in ids]
    assert any(whole and rest for whole, rest in map(whole_characters, data))  # (the case: a token whole and cut)
    full = tok.decode(ids)
    for cut in range(1, len(ids)):
        prompt, out = ids[:cut], ids[cut:]
        shown = codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(data[:cut]))  # (whole chars only)
        assert tok.whole_text(prompt) == shown, cut
        for sizes in ([1] * len(out), [len(out)]):
            d, pieces, last = _stream(tok, out, sizes, context=prompt)
            assert "".join(pieces) + last == full[len(shown):], (cut, sizes)
        d, pieces, last = _stream(tok, prompt, [1] * cut)  # (an output cut short there: its decode)
        assert "".join(pieces) + last == tok.decode(prompt), cut


@pytest.mark.parametrize("text", ["The capital of France is Paris. Hello world", TEXTS["accents"], TEXTS["mixed"]])
def test_the_first_token_decodes_as_it_does_after_the_prompt(sentencepiece_tok, text):
    """vLLM's text: decode(prompt + output) less decode(prompt). Without the prompt's last tokens as
    context, a SentencePiece decoder drops the leading space of the first generated token."""
    tok = sentencepiece_tok
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(7)
    for cut in sorted({1, len(ids) // 2, len(ids) - 1, *rng.sample(range(1, len(ids)), 5)}):
        prompt, out = ids[:cut], ids[cut:]
        expected = tok.decode(prompt + out)[len(tok.decode(prompt)):]
        d = IncrementalDetokenizer(tok, context=prompt)
        assert "".join(d.add([t]) for t in out) + d.finish() == expected, cut
        if "\ufffd" not in tok.decode(prompt):  # (a prompt that ends inside a character: no whole text)
            d = IncrementalDetokenizer(tok, context=prompt)
            assert d.add(out) + d.finish() == expected
    # a stop string at the very start of the output sees the space too, as vLLM's does
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = tok.encode("The capital of France is Paris. Hello", add_special_tokens=False)[len(prompt):]
    d = IncrementalDetokenizer(tok, stop=[" Paris"], context=prompt)
    assert d.add(out) + d.finish() == "" and d.stopped


def test_min_tokens_counts_generated_tokens_not_the_context(sentencepiece_tok):
    tok = sentencepiece_tok
    ids = tok.encode("The quick brown fox jumps over", add_special_tokens=False)
    prompt, out = ids[:3], ids[3:]
    expected = tok.decode(ids)[len(tok.decode(prompt)):]
    assert "jumps" in expected
    d = IncrementalDetokenizer(tok, stop=["jumps"], min_tokens=len(out) + 1, context=prompt)
    assert d.add(out) + d.finish() == expected and not d.stopped
    d = IncrementalDetokenizer(tok, stop=["jumps"], min_tokens=len(out), context=prompt)
    assert d.add(out) + d.finish() == expected[:expected.index("jumps")] and d.stopped


def test_token_text_keeps_the_space_a_sentencepiece_token_carries(sentencepiece_tok, tok):
    sp = sentencepiece_tok
    ids = sp.encode("Paris. Hello world", add_special_tokens=False)
    assert "".join(sp.token_text(i) for i in ids) == " Paris. Hello world"  # (each as it reads in a text)
    assert sp.token_text(sp.encode("Hello", add_special_tokens=False)[0]).startswith(" ")
    ids = tok.encode(TEXTS["ascii"], add_special_tokens=False)  # a byte-level BPE: one token decodes alone
    assert [tok.token_text(i) for i in ids] == [tok.decode([i], skip_special_tokens=False) for i in ids]


def test_special_tokens_show_when_not_skipped_and_a_kept_stop_string_ends_the_text(tok):
    ids = tok.encode(TEXTS["special_tokens"], add_special_tokens=False)
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(d.add([t]) for t in ids) + d.finish() == tok.decode(ids, skip_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    assert "<|im_end|>" not in "".join(d.add([t]) for t in ids) + d.finish()
    ids = tok.encode(TEXTS["ascii"], add_special_tokens=False)
    for include in (False, True):
        d = IncrementalDetokenizer(tok, stop=["lazy", "brown"], include_stop=include)
        text = "".join(d.add([t]) for t in ids) + d.finish()
        assert text == ("The quick brown" if include else "The quick ") and d.stopped
    # both at one place in one piece: the longer is kept whole
    d = IncrementalDetokenizer(tok, stop=["brown", "brown fox"], include_stop=True)
    assert d.add(ids) + d.finish() == "The quick brown fox"


def test_a_prompt_that_ends_inside_a_character_gives_the_whole_character(tok):
    """A token-id prompt can end partway through a character's bytes: the character the first
    generated bytes complete is the answer's, whole (vLLM gives '日本語 ok', not '本語 ok' or '�本語')."""
    for text in ("say 日本語 ok", TEXTS["emoji"], TEXTS["cjk"]):
        ids = tok.encode(text, add_special_tokens=False)
        cuts = [c for c in range(1, len(ids)) if tok.decode(ids[:c]).endswith("\ufffd")]
        assert cuts, text  # (the byte-level tokenizer splits these characters)
        for cut in cuts:
            prompt, out = ids[:cut], ids[cut:]
            want = tok.decode(ids)[len(tok.decode(prompt).rstrip("\ufffd")):]
            d = IncrementalDetokenizer(tok, context=prompt)
            assert "".join(d.add([t]) for t in out) + d.finish() == want, (text, cut)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_token_bytes_join_up_to_the_text_and_pieces_are_named_by_their_bytes(tok, name):
    """TextTokenizer.token_bytes: a byte-level vocabulary's entries back to their bytes (special tokens
    as their text), adding up to the text; token_label names a piece of a character "bytes:\\xNN"
    (OpenAI's logprobs), any other token by its text."""
    text = TEXTS[name]
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    for i in ids:
        raw, label = tok.token_bytes(i), tok.token_label(i)
        try:
            assert label == raw.decode("utf-8") == tok.token_text(i)
        except UnicodeDecodeError:
            assert label == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_token_bytes_of_a_sentencepiece_vocabulary_with_byte_fallback(tmp_path):
    """Llama-style pieces: "▁" for a space and <0xNN> entries for the bytes of what the vocabulary
    lacks; the decoder turns them back (ByteFallback), and token_bytes reads them as their bytes."""
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "▁a": 259, "b": 260}
    t = Tokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.save(str(tmp_path / "tokenizer.json"))
    sp = TextTokenizer(tmp_path)
    ids = sp.encode("▁a▁é", add_special_tokens=False)  # (as a pre-tokenizer would hand it on)
    assert [sp.token_label(i) for i in ids] == [" a", " ", "bytes:\\xc3", "bytes:\\xa9"]
    assert b"".join(sp.token_bytes(i) for i in ids) == " a é".encode()


def test_a_skipped_special_token_inside_a_character_does_not_break_it(tok, byte_id):
    """A special token between the bytes of one character (a model may sample one anywhere): a decode
    that skips special tokens joins the bytes on either side into the character, and so do the pieces,
    however the tokens arrive (the first byte was released as a broken character once the special
    token came after it). Kept as text, the special token does break it, in both."""
    special = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(special) == 1 and special[0] in tok.special_ids
    head = tok.encode("The cheel", add_special_tokens=False)
    ids = head + [byte_id(0xC4), special[0], byte_id(0xAA), byte_id(0xC3), special[0], byte_id(0xA9)]
    whole = tok.decode(ids)
    assert whole.endswith("Īé")
    for sizes in _chunkings(len(ids)):
        d, pieces, last = _stream(tok, ids, sizes)
        assert "".join(pieces) + last == whole, sizes
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(d.add([t]) for t in ids) + d.finish() == tok.decode(ids, skip_special_tokens=False)


def test_a_skipped_special_token_inside_a_character_with_byte_fallback(byte_fallback_tok):
    """The same with a SentencePiece byte-fallback vocabulary: a skipped special token among a
    character's bytes changes nothing, whole (the decode) or cut short at the end (one U+FFFD, as
    without it; it gave three); and a prompt that ends with a character's first byte and a special
    token still gives the answer that character whole once the generated bytes complete it."""
    tok = byte_fallback_tok
    byte = {b: tok._tok.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0xAD)}
    special = next(iter(tok.special_ids))
    hello = tok.encode("Hello", add_special_tokens=False)
    for tail in ([byte[0xE4], byte[0xB8]], [byte[0xE4], byte[0xB8], byte[0xAD]]):
        plain = hello + tail
        _, pieces, last = _stream(tok, plain, [len(plain)])
        want = "".join(pieces) + last
        assert want == ("Hello\ufffd" if len(tail) == 2 else tok.decode(plain))
        ids = hello + tail[:1] + [special] + tail[1:]
        for sizes in _chunkings(len(ids)):
            _, pieces, last = _stream(tok, ids, sizes)
            assert "".join(pieces) + last == want, (ids, sizes)
    d = IncrementalDetokenizer(tok, context=hello + [byte[0xE4], special])
    assert d.add([byte[0xB8]]) + d.add([byte[0xAD]]) + d.finish() == "中"


def test_a_stop_string_ends_at_the_token_that_completes_it_even_where_that_token_begins_a_character(
        mixed_byte_level_tok):
    """A byte-level token may hold a stop string's last character and the first bytes of the next: the
    stop string ends the text at that token, not tokens later once the next character is whole (the
    gateway counts no token after the one that completes a stop string)."""
    tok = mixed_byte_level_tok
    ids = tok.encode("x 中文 ab 一丁 七 三上", add_special_tokens=False)
    data = [tok.token_bytes(i) for i in ids]
    cases = [k for k, b in enumerate(data) if whole_characters(b)[0] and whole_characters(b)[1]
             and not whole_characters(b"".join(data[:k]))[1]]
    assert cases  # (the case: a token with whole characters and a cut one, after whole ones)
    for k in cases:
        before = tok.whole_text(ids[:k + 1])  # (up to the cut character)
        for stop, include in ((before[-2:], False), (before[-1:], True)):
            if not stop.strip():
                continue
            d = IncrementalDetokenizer(tok, stop=[stop], include_stop=include)
            shown = "".join(d.add([t]) for t in ids[:k + 1])
            assert d.stopped and d.matched == stop, (k, stop)
            cut = before.find(stop)
            assert shown + d.finish() == before[:cut + len(stop) if include else cut], (k, stop)
