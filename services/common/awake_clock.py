"""Time a process spent awake, the clock for every peer-silence timeout.

A process that was itself stopped (SIGSTOP, a paused VM, a host swapping) must not blame its peers
for the silence: ZMQ's I/O thread stopped with it, so what they sent meanwhile reaches the socket
only after the first poll on waking. Measured by this clock, a stall of one's own counts as at most
`grace_s`, so a peer is presumed dead only after it was silent while we listened.
"""

from __future__ import annotations

import time

import zmq


class AwakeClock:
    """Like `time.monotonic()`, except that a gap longer than `grace_s` between two readings counts
    as `grace_s`. Read it at least every `grace_s` while listening (each loop turn), or waiting
    time is lost too."""

    def __init__(self, grace_s: float = 1.0) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be positive, got {grace_s}")
        self.grace_s = grace_s
        self._last = time.monotonic()
        self._awake = 0.0

    def now(self) -> float:
        wall = time.monotonic()
        self._awake += min(wall - self._last, self.grace_s)
        self._last = wall
        return self._awake


POLL_SLICE_S = 0.1


def poll_awake(sock: zmq.Socket, timeout_s: float) -> bool:
    """`sock.poll` for `timeout_s` of awake time: a stop in the middle does not use the wait up
    before the answer already sent could be read."""
    clock = AwakeClock()
    deadline = clock.now() + timeout_s
    while True:
        left = deadline - clock.now()
        if left <= 0:
            return False
        if sock.poll(max(1, int(min(left, POLL_SLICE_S) * 1000))):
            return True
