"""Byte-level tokenizer: every UTF-8 byte is a token, plus one end-of-document token.
(Real tokenizers go through the ``tokenizers`` library: ``data/prepare.py``.)"""

from __future__ import annotations

EOS = 256
VOCAB_SIZE = 257


def encode(text: str, add_eos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return ids + [EOS] if add_eos else ids


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
