"""Incremental detokenization: UTF-8 safe deltas and exact stop-string cuts that are never taken back."""

from __future__ import annotations

import pytest

from tandem.workers.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """A byte-level BPE stand-in: each id is a byte string; decoding replaces broken UTF-8 with U+FFFD."""

    def __init__(self, pieces: list[bytes], special: set[int] = frozenset(), strip_leading_space: bool = False):
        self.pieces = pieces
        self.special = special
        # SentencePiece drops the leading space of the first decoded token.
        self.strip_leading_space = strip_leading_space

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))
        text = data.decode("utf-8", errors="replace")
        if self.strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def ids_for(self, *pieces: bytes) -> list[int]:
        return [self.pieces.index(p) for p in pieces]


def split_bytes(text: str) -> list[bytes]:
    return [bytes([b]) for b in text.encode()]


def make_tokenizer(extra: list[bytes] = ()) -> ByteTokenizer:
    pieces = [b"<eos>", b"<p>", b"Hello", b" world", b"!", b" wo", b"rld", b".", b" Bye", b"ST", b"OP", b"x", b" "]
    pieces += [bytes([b]) for b in range(128, 256)]  # raw high bytes, to split multi-byte characters
    pieces += list(extra)
    return ByteTokenizer(pieces, special={0})


def stream(tok, ids, stop=(), include=False, prompt=(1,)):
    detok = IncrementalDetokenizer(tok, list(prompt), stop, include)
    deltas = []
    for i in ids:
        deltas.append(detok.add_token(i))
        if detok.stopped:
            break
    else:
        deltas.append(detok.flush())
    return deltas, detok


def byte_ids(tok: ByteTokenizer, text: str) -> list[int]:
    return [tok.pieces.index(b) for b in split_bytes(text)]


def test_deltas_reassemble_the_text():
    tok = make_tokenizer()
    ids = tok.ids_for(b"Hello", b" world", b"!")
    deltas, _ = stream(tok, ids)
    assert deltas == ["Hello", " world", "!", ""]


@pytest.mark.parametrize("text", ["é", "日本", "🙂!", "a€b"])
def test_multibyte_characters_split_over_tokens_are_never_broken(text):
    tok = make_tokenizer([b"a", b"b"])
    ids = [i for ch in text for i in byte_ids(tok, ch)]  # one token per byte: the worst split
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Nothing is emitted until the first character is complete.
    first_len = len(text[0].encode())
    assert deltas[:first_len - 1] == [""] * (first_len - 1) and deltas[first_len - 1] != ""


def test_special_tokens_are_skipped():
    tok = make_tokenizer()
    deltas, _ = stream(tok, tok.ids_for(b"Hello", b"<eos>", b"!"))
    assert "".join(deltas) == "Hello!"


def test_leading_space_survives_a_tokenizer_that_strips_it_at_the_start():
    tok = ByteTokenizer([b"<s>", b" Hello", b" world"], strip_leading_space=True)
    detok = IncrementalDetokenizer(tok, [0, 1], ())
    assert detok.add_token(2) == " world", "prompt context keeps the space a standalone decode would drop"


def test_stop_string_cuts_exactly_before_it():
    tok = make_tokenizer()
    deltas, detok = stream(tok, tok.ids_for(b"Hello", b" world", b"!", b" Bye"), stop=["world"])
    assert "".join(deltas) == "Hello "
    assert detok.stopped and detok.matched_stop == "world"


def test_stop_string_split_across_tokens():
    tok = make_tokenizer()
    ids = tok.ids_for(b"Hello", b" wo", b"rld", b".", b" Bye")
    deltas, detok = stream(tok, ids, stop=["world."])
    assert "".join(deltas) == "Hello "
    assert detok.stopped


def test_include_stop_str_in_output():
    tok = make_tokenizer()
    ids = tok.ids_for(b"Hello", b" wo", b"rld", b"!", b" Bye")
    deltas, _ = stream(tok, ids, stop=["world"], include=True)
    assert "".join(deltas) == "Hello world"


def test_earliest_stop_string_wins():
    tok = make_tokenizer()
    ids = tok.ids_for(b"Hello", b" world", b"!")
    deltas, detok = stream(tok, ids, stop=["!", "lo w"])
    assert "".join(deltas) == "Hel" and detok.matched_stop == "lo w"


def test_stop_string_made_of_a_multibyte_character_split_over_tokens():
    tok = make_tokenizer()
    ids = tok.ids_for(b"Hello") + byte_ids(tok, "€") + tok.ids_for(b"!")
    deltas, detok = stream(tok, ids, stop=["€"])
    assert "".join(deltas) == "Hello" and detok.stopped
    assert all("\ufffd" not in d for d in deltas)


def test_streamed_text_is_never_taken_back():
    tok = make_tokenizer()
    stop = "STOP!"
    ids = tok.ids_for(b"Hello", b" ", b"ST", b"x", b" ", b"ST", b"OP", b"!", b" Bye")
    detok = IncrementalDetokenizer(tok, [1], [stop])
    emitted = ""
    for i in ids:
        emitted += detok.add_token(i)
        # Whatever has been emitted is a prefix of the final answer and never contains the stop.
        assert "Hello STx ".startswith(emitted)
        if detok.stopped:
            break
    assert emitted == "Hello STx "


def test_hold_back_is_len_longest_stop_minus_one():
    tok = make_tokenizer(extra=[b"a", b"b", b"c", b"d"])
    detok = IncrementalDetokenizer(tok, [1], ["abc", "z"])
    a, b, d = (tok.pieces.index(x) for x in (b"a", b"b", b"d"))
    # The last two characters could be the start of "abc", whatever they are: held back.
    assert detok.add_token(d) == ""
    assert detok.add_token(d) == ""
    assert detok.add_token(a) == "d"
    assert detok.add_token(b) == "d"
    assert detok.flush() == "ab", "finishing for another reason releases the held-back text"


def test_no_stop_strings_means_no_hold_back():
    tok = make_tokenizer()
    detok = IncrementalDetokenizer(tok, [1], [])
    assert detok.add_token(tok.pieces.index(b"Hello")) == "Hello"


def test_flush_emits_a_dangling_partial_character():
    tok = make_tokenizer()
    detok = IncrementalDetokenizer(tok, [1], [])
    first_byte = byte_ids(tok, "é")[0]
    assert detok.add_token(first_byte) == ""
    assert detok.flush() == "\ufffd", "a generation cut mid-character still reports its bytes"


def test_nothing_after_a_stop():
    tok = make_tokenizer()
    detok = IncrementalDetokenizer(tok, [1], ["!"])
    assert detok.add_token(tok.pieces.index(b"!")) == "" and detok.stopped
    assert detok.add_token(tok.pieces.index(b"Hello")) == ""
    assert detok.flush() == ""
