"""Stop strings over streamed text: matches spanning chunks, inclusion, hold-back, and which string wins."""

from __future__ import annotations

import pytest

from app.engine.core.stop_checker import (
    StopChecker,
    StopStringStream,
    find_stop_string,
    partial_stop_length,
)


def stream(chunks: list[str], stop: list[str], include: bool = False) -> tuple[list[str], str, str | None]:
    """Feed chunks; return what was sent after each chunk (plus a final flush), the text kept and the stop."""
    s = StopStringStream(StopChecker(stop, include))
    sent = [s.push(c) for c in chunks]
    if not s.stopped:
        sent.append(s.flush())
    return sent, s.text, s.stop


def test_stop_string_spanning_chunks_is_excluded() -> None:
    sent, text, stop = stream(["Hello", " wor", "ld##", "#END", "ignored"], ["###"])
    assert stop == "###"
    assert text == "Hello world"
    assert "".join(sent) == "Hello world"
    # "##" could start "###": held back until it completes the stop string
    assert sent[:3] == ["Hello", " wor", "ld"]


def test_stop_string_included_on_request() -> None:
    sent, text, stop = stream(["a", "bS", "TO", "Pxyz"], ["STOP"], include=True)
    assert (text, stop) == ("abSTOP", "STOP")
    assert "".join(sent) == "abSTOP"
    assert sent[1] == "bS"  # nothing is held back when the stop string will be sent anyway


def test_hold_back_released_when_not_a_stop_string() -> None:
    checker = StopChecker(["</end>"])
    check = checker.check("value </e", 4)
    assert not check.stopped
    assert check.safe_len == len("value ")
    sent, text, stop = stream(["value </e", "m> done"], ["</end>"])
    assert stop is None and text == "value </em> done"
    assert sent == ["value ", "</em> done", ""]


def test_flush_releases_the_tail_when_finished_otherwise() -> None:
    sent, text, _ = stream(["abc", "</"], ["</end>"])
    assert sent == ["abc", "", "</"]
    assert text == "abc</"


def test_earliest_ending_stop_string_wins() -> None:
    # Character by character "b" completes before "abc": the result must not depend on chunking.
    assert find_stop_string("xabc", 4, ["abc", "b"]) == (2, "b")
    assert StopChecker(["abc", "b"]).check("xabc", 4).text == "xa"
    # Same end: the longer string wins (it starts earlier).
    assert find_stop_string("xabc", 4, ["c", "bc"]) == (2, "bc")
    # Several occurrences: the first one.
    assert StopChecker(["!"]).check("a!b!", 4).text == "a"


def test_only_occurrences_ending_in_new_text_are_reported() -> None:
    assert find_stop_string("stop here", 0, ["stop"]) is None
    assert find_stop_string("xx stop", 2, ["stop"]) == (3, "stop")  # starts in old text, ends in new
    assert find_stop_string("stop xx", 2, ["stop"]) is None  # already seen by an earlier check


def test_partial_stop_length() -> None:
    assert partial_stop_length("abc", ["cde"]) == 1
    assert partial_stop_length("abcd", ["cde", "bcdx"]) == 3
    assert partial_stop_length("abc", ["abc"]) == 0  # a full match is a match, not a prefix
    assert partial_stop_length("", ["abc"]) == 0
    assert partial_stop_length("xyz", ["abc"]) == 0


def test_no_stop_strings_and_validation() -> None:
    check = StopChecker([]).check("anything", 8)
    assert (check.text, check.stop, check.safe_len) == ("anything", None, 8)
    assert not StopChecker([])
    with pytest.raises(ValueError, match="empty"):
        StopChecker([""])


def test_stream_never_retracts_text() -> None:
    # Whatever the chunking, what was sent is a prefix of the final text and equals it at the end.
    full = "one two <|im_end|> three"
    for size in range(1, len(full) + 1):
        chunks = [full[i : i + size] for i in range(0, len(full), size)]
        s = StopStringStream(StopChecker(["<|im_end|>", "two  "]))
        sent = ""
        for c in chunks:
            sent += s.push(c)
            assert s.text.startswith(sent)
        assert s.stopped and s.text == "one two " and sent == "one two "
