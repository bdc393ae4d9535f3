"""Stop strings over streamed, detokenized text (no tokenizer involved: it only sees characters).

A stop string can span several tokens, so it is searched in the text, not in the token ids. Text grows by
appending; each check looks only at occurrences that *end* inside the newly appended characters (earlier
ones were seen by earlier checks), so a check costs O(new text + longest stop string), not O(text).

Which stop string wins when several occur in one chunk: the one that ends first (then the longest). That is
what a character-by-character check would have found, so the result does not depend on how the text was
split into tokens, and no stop string ever remains in the returned text.

Streaming: a client must not receive characters that may turn out to be the start of a stop string (they
would have to be retracted). :meth:`StopChecker.check` therefore also says how many leading characters are
safe to send now; the held-back suffix is released when the next chunk shows it is not a stop string, or by
:meth:`StopStringStream.flush` when the sequence ends for another reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["StopCheck", "StopChecker", "StopStringStream", "find_stop_string", "partial_stop_length"]


@dataclass(frozen=True, slots=True)
class StopCheck:
    """The outcome of one check.

    ``text`` is the text to keep (the whole input when no stop string matched, otherwise truncated before
    the stop string, or after it with ``include_stop_str_in_output``); ``stop`` is the matched string;
    ``safe_len`` is how many leading characters of ``text`` may be streamed now (all of them once stopped).
    """

    text: str
    stop: str | None
    safe_len: int

    @property
    def stopped(self) -> bool:
        return self.stop is not None


def find_stop_string(text: str, num_new_chars: int, stop: Iterable[str]) -> tuple[int, str] | None:
    """The start index and value of the first stop string that ends in the last ``num_new_chars`` characters.

    "First" means the earliest end, then the longest string (see the module docstring). None if none ends
    there.
    """
    if num_new_chars <= 0:
        return None
    new_start = len(text) - num_new_chars
    best: tuple[int, int, str] | None = None  # (end, -len, stop): min() order = earliest end, then longest
    for s in stop:
        # An occurrence ending in the new text starts at new_start - len(s) + 1 at the earliest.
        index = text.find(s, max(0, new_start - len(s) + 1))
        if index < 0:
            continue
        candidate = (index + len(s), -len(s), s)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    end, neg_len, s = best
    return end + neg_len, s


def partial_stop_length(text: str, stop: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

    Those characters could still become a stop string when more text arrives, so they are held back.
    """
    longest = 0
    for s in stop:
        # Only suffixes longer than the current best can improve it; try the longest candidates first.
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class StopChecker:
    """One request's stop strings and output option; immutable, so one instance can serve all ``n`` samples."""

    def __init__(self, stop: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        self.stop: tuple[str, ...] = tuple(stop)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        self.include_stop_str_in_output = include_stop_str_in_output

    def __bool__(self) -> bool:
        return bool(self.stop)

    def check(self, text: str, num_new_chars: int) -> StopCheck:
        """Check ``text`` (the output so far, whose last ``num_new_chars`` characters were just appended)."""
        if not self.stop:
            return StopCheck(text, None, len(text))
        found = find_stop_string(text, num_new_chars, self.stop)
        if found is not None:
            start, s = found
            kept = text[: start + len(s)] if self.include_stop_str_in_output else text[:start]
            return StopCheck(kept, s, len(kept))
        if self.include_stop_str_in_output:
            # Whatever follows, these characters end up in the output (as text, or as part of an included
            # stop string that ends later), so nothing needs holding back.
            return StopCheck(text, None, len(text))
        return StopCheck(text, None, len(text) - partial_stop_length(text, self.stop))


class StopStringStream:
    """Stateful helper for one streamed sequence: feed text chunks, get the characters safe to send."""

    def __init__(self, checker: StopChecker) -> None:
        self.checker = checker
        self.text = ""  # the output text so far (truncated once a stop string matched)
        self.stop: str | None = None
        self._sent = 0

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def push(self, new_text: str) -> str:
        """Append ``new_text``; return what may be sent now. Once stopped, further text is ignored."""
        if self.stopped:
            return ""
        self.text += new_text
        result = self.checker.check(self.text, len(new_text))
        self.text, self.stop = result.text, result.stop
        return self._release(result.safe_len)

    def flush(self) -> str:
        """The held-back remainder, for when the sequence finished without a stop string (eos, length)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        delta = self.text[self._sent : upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        return delta
