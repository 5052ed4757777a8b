"""The clock of every peer-silence timeout: a stall of one's own is not the peers' silence."""

from __future__ import annotations

import time

import pytest
import zmq

from services.common import awake_clock
from services.common.awake_clock import AwakeClock, poll_awake


def test_a_gap_longer_than_the_grace_counts_as_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    wall = iter([100.0, 100.4, 100.9, 160.9, 161.2])
    monkeypatch.setattr(awake_clock.time, "monotonic", lambda: next(wall))
    clock = AwakeClock(grace_s=1.0)
    assert [clock.now() for _ in range(4)] == pytest.approx([0.4, 0.9, 1.9, 2.2])


def test_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="-1"):
        AwakeClock(grace_s=-1)


def test_poll_awake_sees_a_message_and_times_out_without_one() -> None:
    context = zmq.Context()
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        a.bind("inproc://awake")
        b.connect("inproc://awake")
        started = time.monotonic()
        assert not poll_awake(b, 0.3)
        assert 0.25 < time.monotonic() - started < 5.0
        a.send(b"x")
        assert poll_awake(b, 5.0)
    finally:
        a.close(linger=0)
        b.close(linger=0)
        context.term()
