"""The byte-level tokenizer: any text is a prompt, and decoding gives it back."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvwire.engine.tokenizer import BOS, EOS, VOCAB_SIZE, ByteTokenizer

TOK = ByteTokenizer()


@given(st.text())
def test_round_trip(text: str) -> None:
    ids = TOK.encode(text)
    assert ids[0] == BOS and all(0 <= t < VOCAB_SIZE for t in ids)
    assert TOK.decode(ids) == text
    assert TOK.decode([*ids, EOS]) == text


@given(st.text())
def test_stream_decoder_concatenates_to_the_text(text: str) -> None:
    dec = TOK.stream_decoder()
    pieces = [dec.push(t) for t in TOK.encode(text)]
    assert "".join(pieces) + dec.flush() == text


def test_multibyte_character_appears_on_its_last_byte() -> None:
    dec = TOK.stream_decoder()
    ids = TOK.encode("é", add_bos=False)
    assert ids == [0xC3, 0xA9]
    assert dec.push(ids[0]) == "" and dec.push(ids[1]) == "é"


def test_invalid_bytes_are_replaced_not_raised() -> None:
    assert TOK.decode([0xFF, ord("a")]) == "\ufffda"
