"""Slots of the CPU swap pool, one chunk's bytes each. Bookkeeping only; the worker moves the bytes."""

from __future__ import annotations


class SwapSpace:
    """Invariant: every slot is on `free`, on `draining`, or in exactly one request's entry of `held`.

    Slots a restore reads this step are `draining` until the step ends: the worker copies swap-out
    before swap-in, so handing them to a victim of the same step would overwrite them before the read.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.draining: list[int] = []
        # Per offloaded request: one slot list per allocator group, aligned with its table (-1 holes).
        self.held: dict[str, list[list[int]]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"take({n}) with only {len(self.free)} free swap slots")
        return [self.free.pop() for _ in range(n)]

    def give_back(self, rid: str, *, read_this_step: bool = False) -> list[list[int]]:
        layout = self.held.pop(rid)
        slots = (s for table in layout for s in table if s >= 0)
        (self.draining if read_this_step else self.free).extend(slots)
        return layout

    def end_step(self) -> None:
        self.free.extend(self.draining)
        self.draining.clear()

    def check(self) -> None:
        used = [s for layout in self.held.values() for table in layout for s in table if s >= 0]
        if sorted(used + self.free + self.draining) != list(range(self.num_slots)):
            raise AssertionError("swap slots leaked or double-booked")
