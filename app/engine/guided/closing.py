"""Closing a constrained output before its token budget runs out, so that it still parses and conforms.

A small model can loop inside an unbounded JSON string (``"Sakura-Sakura-Sakura-..."``) until ``max_tokens``
cuts it, and a cut JSON document does not parse. Near the end of the budget :class:`BudgetCloser` estimates,
on a fork of the sequence's matcher, how many tokens the shortest way out of the grammar takes: at each
simulated step it takes the allowed token that closes most (see :func:`closing_preference`), until the
grammar is complete. When that estimate plus a safety margin reaches the tokens left, the sequence switches
to *closing*: from then on its mask row allows only the token the same policy picks, so the output ends as a
complete document (then the stop token) within the budget. Such a sequence reports finish_reason
``"length"`` as a cut one does, since the budget, not the model, ended it; its text is valid for the grammar.

The estimate runs only in the last :attr:`BudgetCloser.window` tokens of a constrained sequence's budget,
about 30-100 us per simulated token, so a request that finishes well inside its budget never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from app.engine.guided.bitmask import bitmask_words

__all__ = ["BudgetCloser", "closing_preference"]

_UNREACHABLE = 2**30  # the preference of a token the policy never picks (and of the padding bits)
_QUOTE = ord('"')
_CLOSERS = frozenset(b"]}")
_OPENERS = frozenset(b"[{")
_STRUCTURAL = frozenset(b'"[]{},:')
CONTENT_CLASS = 4


def closing_preference(token: bytes, is_stop: bool) -> int:
    """Lower is picked first when closing. Classes, best first: a stop token (the grammar may end); a quote
    followed only by closers (``"``, ``""``, ``"}``: ends a string, maybe more); closers alone (``}``, ``]]``);
    other JSON punctuation (``,"``, ``[]``, ``:"``); anything else (content: key names, digits, enum values,
    pattern characters), whose order :meth:`BudgetCloser.pick` settles by first byte. Within the punctuation
    class: more closers than openers first (``[]`` before ``["``), then ending in a quote (``:"`` before
    ``:",``, which would leave a comma inside the string); within every class, longer first."""
    if is_stop:
        return 0
    if not token:
        return _UNREACHABLE
    if token[0] == _QUOTE and all(b in _CLOSERS or b == _QUOTE for b in token):
        cls = 1
    elif all(b in _CLOSERS for b in token):
        cls = 2
    elif all(b in _STRUCTURAL for b in token):
        cls = 3
    else:
        cls = CONTENT_CLASS
    net_close = sum(b in _CLOSERS for b in token) - sum(b in _OPENERS for b in token)
    open_quote = cls == 3 and token[-1] != _QUOTE
    return (
        cls * 1_000_000
        + (50 - max(-49, min(49, net_close))) * 10_000
        + open_quote * 1_000
        + (999 - min(len(token), 999))
    )


class BudgetCloser:
    """The closing policy over one vocabulary: a preference per token, the pick from a mask row, and the
    estimate of the tokens a matcher needs to complete its grammar."""

    window = 64  # estimate only when this many tokens, or fewer, are left
    margin = 6  # spare tokens kept when deciding to close: a free token may open something that needs closing

    def __init__(self, decoded_vocab: Seq[bytes], vocab_size: int, stop_token_ids: Seq[int]) -> None:
        words = bitmask_words(vocab_size)
        stops = set(stop_token_ids)
        preference = [
            closing_preference(decoded_vocab[t] if t < len(decoded_vocab) else b"", t in stops)
            for t in range(vocab_size)
        ]
        self._preference = torch.full((words * 32,), _UNREACHABLE, dtype=torch.int32)
        self._preference[:vocab_size] = torch.tensor(preference, dtype=torch.int32)
        # content tokens are grouped by first byte; groups sort by (size, alphanumeric, byte); 256: no bytes
        self._first_byte = torch.full((words * 32,), 256, dtype=torch.int64)
        firsts = [
            decoded_vocab[t][0] if t < len(decoded_vocab) and decoded_vocab[t] else 256
            for t in range(vocab_size)
        ]
        self._first_byte[:vocab_size] = torch.tensor(firsts, dtype=torch.int64)
        self._byte_order = torch.tensor(
            [2 * b + (chr(b).isalnum() and b < 128) * 512 for b in range(256)] + [2**20], dtype=torch.int64
        )
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._scratch = torch.empty((1, words), dtype=torch.int32)

    def pick(self, row: torch.Tensor, previous: int | None = None) -> int | None:
        """The allowed token of packed mask ``row`` that closes most; None when the row allows nothing.

        When only content is allowed, what the grammar asks for specifically comes first: the allowed first
        byte with the fewest tokens (``@`` in an e-mail pattern before the thousands of letters), punctuation
        before letters and digits on a tie, and not the first byte of ``previous`` (the token before) while
        another is allowed, so that a repeatable character class cannot hold the policy in a loop."""
        allowed = ((row.view(-1, 1) >> self._shifts) & 1).view(-1).bool()
        ranked = torch.where(allowed, self._preference, _UNREACHABLE)
        token = int(torch.argmin(ranked))
        best = int(ranked[token])
        if best >= _UNREACHABLE:
            return None
        if best < CONTENT_CLASS * 1_000_000:
            return token
        sizes = torch.bincount(self._first_byte[allowed], minlength=257)
        order = sizes * 2**21 + self._byte_order
        order[sizes == 0] = 2**62
        if previous is not None and 0 <= previous < self._first_byte.numel():
            repeat = int(self._first_byte[previous])
            if int((sizes > 0).sum()) > 1:
                order[repeat] = 2**62
        byte = int(torch.argmin(order))
        ranked = torch.where(allowed & (self._first_byte == byte), self._preference, _UNREACHABLE)
        return int(torch.argmin(ranked))

    def tokens_to_close(self, matcher: Any, limit: int, previous: int | None = None) -> int:
        """Tokens the policy takes from ``matcher``'s state (an xgrammar matcher, left untouched) until its
        grammar is complete, not counting the stop token; ``limit + 1`` when that takes more than ``limit``."""
        fork = matcher.fork()
        token = previous
        for count in range(limit + 1):
            if fork.is_completed():
                return count
            fork.fill_next_token_bitmask(self._scratch, 0)
            token = self.pick(self._scratch[0], token)
            if token is None or not fork.accept_token(token):
                break
        return limit + 1

    def should_close(self, matcher: Any, tokens_left: int, previous: int | None = None) -> bool:
        """Whether a sequence with ``tokens_left`` tokens of budget (this step's included) must start closing
        now: the estimate, the stop token and the margin no longer fit after one more free token."""
        if tokens_left > self.window:
            return False
        needed = self.tokens_to_close(matcher, limit=tokens_left, previous=previous)
        return needed + 1 + self.margin >= tokens_left

    def force(self, bitmask: torch.Tensor, row: int, previous: int | None = None) -> None:
        """Narrow ``bitmask[row]`` to the single token the policy picks after ``previous`` (the sequence's
        last token); left as is when the row allows none."""
        token = self.pick(bitmask[row], previous)
        if token is None:
            return
        bitmask[row] = 0
        bit = token % 32
        bitmask[row, token // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)
