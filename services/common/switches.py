"""Environment switches: a `CBSERVE_*` variable that picks one of a few named paths (a kernel, a
forward), `auto` when unset or empty; any other value is refused by name, with the choices."""

from __future__ import annotations

import os
from collections.abc import Collection


def switch(name: str, choices: Collection[str]) -> str:
    """The value of the switch `name`: one of `choices` (which hold "auto", the default)."""
    value = os.environ.get(name, "auto") or "auto"
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value
