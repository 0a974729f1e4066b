"""GPT-2's byte-level alphabet, which byte-level BPE vocabularies (GPT-2's, Llama 3's, those `mshpc
tokenizer train` makes, and mshpc's byte tokenizer exported) spell their tokens in."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table (Radford et al. 2019, encoder.py): printable bytes stand for themselves,
    the others are moved to code points from 256 up, so every byte is a visible character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
