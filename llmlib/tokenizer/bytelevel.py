"""Byte-level tokens as text: GPT-2's map that lets ``tokenizer.json`` and GGUF store any bytes.

A byte-level BPE token is a byte string, and not every byte string is valid UTF-8; the files
that store vocabularies want text. GPT-2's trick maps each of the 256 bytes to one printable
character (a space is ``Ġ``, a newline ``Ċ``), so a token is written as a string of those.
"""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (``0x20 -> 'Ġ'``, ``0x0a -> 'Ċ'``).

    Printable Latin-1 bytes stand for themselves; the other 68 are shifted to U+0100 onwards. It
    lets ``tokenizer.json`` and GGUF files store arbitrary bytes as ordinary strings.
    """
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def byte_decoder() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def to_bytes(token: str, decoder: dict[str, int], where: str) -> bytes:
    try:
        return bytes(decoder[c] for c in token)
    except KeyError as e:
        raise ValueError(
            f"{where}: token {token!r} is not in byte-level form (character {e.args[0]!r})"
        ) from None


def to_str(b: bytes, encoder: dict[int, str]) -> str:
    return "".join(encoder[x] for x in b)
