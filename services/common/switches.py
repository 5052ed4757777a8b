"""Environment switches: a `CBSERVE_*` variable that picks one of a few named paths (a kernel, a
forward), `auto` when unset or empty; any other value is refused by name, with the choices."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator


def switch(name: str, choices: Collection[str]) -> str:
    """The value of the switch `name`: one of `choices` (which hold "auto", the default)."""
    value = os.environ.get(name, "auto") or "auto"
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


@contextlib.contextmanager
def switched(name: str, value: str | None) -> Iterator[None]:
    """The switch (or any environment variable) `name` set to `value` for what runs inside (None: as
    it is), then as it was: how the device check and the tests run one engine on another path."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
