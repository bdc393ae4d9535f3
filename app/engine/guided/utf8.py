"""A guard against the overlong and surrogate UTF-8 sequences that xgrammar 0.2.8 lets through.

xgrammar matches on bytes. For a character class that reaches U+0800 or above, it accepts any continuation
byte after the lead bytes E0 and F0, and any after ED and F4, although UTF-8 allows only A0-BF after E0, 80-9F
after ED, 90-BF after F0 and 80-8F after F4 (measured: ``E0 80 80`` and ``F0 8F 80 80`` are accepted inside a
JSON string). Such bytes decode to several U+FFFD, so a string under ``maxLength`` can come out longer than its
bound (seen on a byte-fallback tokenizer with a random model). After a token that ends in one of those four
lead bytes, this guard takes the tokens whose first byte would make the sequence invalid out of the mask row:
one AND of a precomputed row per lead byte.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from app.engine.guided.bitmask import bitmask_words

#: the continuation bytes UTF-8 allows right after each lead byte that xgrammar checks too loosely
_ALLOWED_AFTER = {
    0xE0: range(0xA0, 0xC0),
    0xED: range(0x80, 0xA0),
    0xF0: range(0x90, 0xC0),
    0xF4: range(0x80, 0x90),
}


class Utf8Guard:
    """Per token its first and last byte; per guarded lead byte a packed row that clears the tokens whose
    first byte is a continuation byte UTF-8 does not allow after that lead."""

    def __init__(self, decoded_vocab: Seq[bytes], vocab_size: int) -> None:
        self.last_byte = [token[-1] if token else -1 for token in decoded_vocab]
        self.last_byte += [-1] * (vocab_size - len(self.last_byte))
        words = bitmask_words(vocab_size)
        first = torch.full((words * 32,), -1, dtype=torch.int16)  # each token's first byte, -1 when empty
        first[: min(len(decoded_vocab), vocab_size)] = torch.tensor(
            [token[0] if token else -1 for token in decoded_vocab[:vocab_size]], dtype=torch.int16
        )
        continuation = (first >= 0x80) & (first < 0xC0)
        self.rows: dict[int, torch.Tensor] = {}
        for lead, allowed in _ALLOWED_AFTER.items():
            ok = (first >= allowed.start) & (first < allowed.stop)
            self.rows[lead] = _pack(~continuation | ok)

    def restrict(self, bitmask: torch.Tensor, row: int, output_token_ids: Seq[int]) -> None:
        """Clear from ``bitmask[row]`` the tokens that would follow the sequence's last byte invalidly."""
        if not output_token_ids:
            return
        last = output_token_ids[-1]
        lead = self.last_byte[last] if 0 <= last < len(self.last_byte) else -1
        guard = self.rows.get(lead)
        if guard is not None:
            bitmask[row] &= guard


def _pack(keep: torch.Tensor) -> torch.Tensor:
    """A boolean vector (a multiple of 32 long) as xgrammar's int32 words, bit ``i % 32`` of word ``i // 32``."""
    bits = keep.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    words = bits.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
