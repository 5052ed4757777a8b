"""StopStringMatcher: trims at the first completed stop, never leaks part of one, however text is split."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.stop_strings import StopStringMatcher


def run(stops: Sequence[str], deltas: Sequence[str]) -> tuple[str, str | None, int]:
    """Push deltas until a match; return (all emitted text, the match, deltas consumed)."""
    matcher = StopStringMatcher(stops)
    emitted = []
    for consumed, delta in enumerate(deltas, start=1):
        text, matched = matcher.push(delta)
        emitted.append(text)
        if matched is not None:
            assert matcher.flush() == ""
            return "".join(emitted), matched, consumed
    emitted.append(matcher.flush())
    return "".join(emitted), None, len(deltas)


def test_no_stops_passes_text_through_at_once() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == ("abc", None)
    assert matcher.push("") == ("", None)
    assert matcher.flush() == ""


def test_empty_stop_is_rejected() -> None:
    with pytest.raises(ValueError, match="''"):
        StopStringMatcher(["ok", ""])


def test_stop_split_across_deltas_is_never_partly_emitted() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("Hel") == ("Hel", None)
    assert matcher.push("lo ST") == ("lo ", None)
    assert matcher.push("O") == ("", None)
    assert matcher.push("P world") == ("", "STOP")
    assert matcher.matched == "STOP"


def test_false_start_is_released() -> None:
    matcher = StopStringMatcher(["abc"])
    assert matcher.push("xab") == ("x", None)
    assert matcher.push("d") == ("abd", None)
    assert matcher.push("a") == ("", None)
    assert matcher.flush() == "a"


def test_earliest_match_among_several_stops() -> None:
    assert run(["world", "lo"], ["hello world"]) == ("hel", "lo", 1)
    assert run(["lo", "world"], ["hello world"]) == ("hel", "lo", 1)


def test_tie_at_one_position_goes_to_the_stop_listed_first() -> None:
    assert run(["ab", "abc"], ["xabc"]) == ("x", "ab", 1)
    assert run(["abc", "ab"], ["xabc"]) == ("x", "abc", 1)


def test_first_completed_stop_wins_over_a_longer_one_still_open() -> None:
    # "abcd" started earlier but "c" completes first; generation ends there.
    assert run(["abcd", "c"], ["ab", "c", "d"]) == ("ab", "c", 2)
    # In one delta both are complete, and the earlier start wins.
    assert run(["abcd", "c"], ["ab", "cd"]) == ("", "abcd", 2)


def test_self_overlapping_stop() -> None:
    assert run(["aab"], list("aaab")) == ("a", "aab", 4)
    assert run(["abab"], list("abaabab")) == ("aba", "abab", 7)


def test_stop_at_the_very_start_and_pushes_after_a_match() -> None:
    matcher = StopStringMatcher(["</s>"])
    assert matcher.push("</s>tail") == ("", "</s>")
    assert matcher.push("more") == ("", "</s>")
    assert matcher.flush() == ""


def test_unicode_stops() -> None:
    assert run(["世界", "🎉"], ["héllo 世", "界 🎉"]) == ("héllo ", "世界", 2)
    assert run(["🎉!"], ["naïve 🎉", "?", " 🎉", "!"]) == ("naïve 🎉? ", "🎉!", 4)


def test_flush_returns_held_text_without_a_match() -> None:
    matcher = StopStringMatcher(["STOP", "xyz"])
    assert matcher.push("abcST") == ("abc", None)
    assert matcher.flush() == "ST"


def naive_hold(seen: str, stops: Sequence[str]) -> int:
    """The longest suffix of `seen` that is a proper prefix of a stop, by brute force."""
    held = (n for n in range(1, len(seen) + 1) for s in stops if n < len(s) and s.startswith(seen[-n:]))
    return max(held, default=0)


ALPHABET = "ab é世🎉"


@pytest.mark.fuzz
@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_any_split_gives_the_unsplit_answer(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = [0, *sorted(min(cut, len(text)) for cut in cuts), len(text)]
    deltas = [text[start:end] for start, end in itertools.pairwise(bounds)]

    matcher = StopStringMatcher(stops)
    emitted, seen, matched = "", "", None
    for delta in deltas:
        seen += delta
        out, matched = matcher.push(delta)
        emitted += out
        if matched is not None:
            break
        # Holding back exactly the longest stop prefix: nothing leaks, nothing is delayed needlessly.
        assert len(seen) - len(emitted) == naive_hold(seen, stops)
        assert seen.startswith(emitted)

    if matched is None:
        assert emitted + matcher.flush() == text
        assert not any(stop in text for stop in stops)
        return
    # The match is the first completed one: no stop was whole before this delta.
    before = seen[: len(seen) - len(delta)]
    assert not any(stop in before for stop in stops)
    first = min(seen.find(stop) for stop in stops if stop in seen)
    assert emitted == seen[:first]
    assert matched == next(stop for stop in stops if seen.find(stop) == first)
    assert matcher.push("more") == ("", matched)
