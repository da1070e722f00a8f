"""A byte-level tokenizer: token ``b`` (0..255) is byte ``b``; a few special tokens follow."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

BOS = 256
EOS = 257
VOCAB_SIZE = 258


class ByteTokenizer:
    """Any text is a prompt: UTF-8 bytes, prefixed with BOS. Decoding skips special tokens."""

    bos = BOS
    eos = EOS
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder()


class StreamDecoder:
    """Decodes one token at a time; a multi-byte character appears once its last byte arrives."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if not 0 <= token < 256:
            return ""
        return self._dec.decode(bytes((token,)))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
