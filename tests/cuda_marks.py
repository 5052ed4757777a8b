"""The marks of a test that needs a CUDA device: skipped without one, run by `make gpu-check`
(`pytest -m cuda`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

F = TypeVar("F", bound=Callable[..., object])

CUDA_MARKS = (
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)"),
)


def cuda_only(test: F) -> F:
    for mark in CUDA_MARKS:
        test = mark(test)
    return test
