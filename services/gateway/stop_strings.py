"""Stop strings over a stream of text deltas: emit what is safe, trim the match, never leak part of it.

Invariants (for the deltas pushed so far, `seen` = their concatenation):
- Without a match, `"".join(emitted) + flush() == seen`, and what is held back is the longest suffix
  of `seen` that is a proper prefix of some stop string (so no stop is ever partly emitted, however
  it is split across deltas). With no stop strings nothing is held back.
- A match is reported by the push whose delta completes the first occurrence of any stop string;
  then `"".join(emitted) == seen[:i]` with `i` the earliest start of a stop occurrence in `seen` (ties
  at one position go to the stop listed first). Like vLLM and the OpenAI API, a longer stop that
  began earlier but would complete only in later text does not count: generation ends at the first
  completed stop. After a match the matcher is finished: every later push returns ("", that stop)
  and flush returns "".
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string in one request's streamed text."""

    def __init__(self, stops: Sequence[str]) -> None:
        for stop in stops:
            if not stop:
                raise ValueError(f"stop strings must be non-empty, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stops))
        # Proper prefixes only: a suffix equal to a whole stop is a match, never held back.
        self._prefixes = frozenset(stop[:n] for stop in self._stops for n in range(1, len(stop)))
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
        self._pending = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None while none has."""
        return self._matched

    def push(self, text: str) -> tuple[str, str | None]:
        """Add a delta; return (text safe to emit now, the matched stop string or None)."""
        if self._matched is not None:
            return "", self._matched
        if not self._stops:
            return text, None
        # Pending text holds no whole stop, so any match ends in `text`; searching all of it is cheap
        # because pending is shorter than the longest stop.
        pending = self._pending + text
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = pending.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            self._pending, self._matched = "", best[1]
            return pending[: best[0]], best[1]
        held = self._held_length(pending)
        self._pending = pending[len(pending) - held :]
        return pending[: len(pending) - held], None

    def flush(self) -> str:
        """End of stream without a match: return the held-back text ("" after a match)."""
        pending, self._pending = self._pending, ""
        return pending

    def _held_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-length:] in self._prefixes:
                return length
        return 0
