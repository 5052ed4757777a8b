"""Session-wide fixtures: tiny random models per family and the converted default model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.model_source import prepare_default_model
from tests.tiny_models import tiny_model_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A callable family -> model directory; each family is built at most once per session."""
    root = tmp_path_factory.mktemp("tiny_models")

    def get(family: str) -> Path:
        return tiny_model_dir(family, root)

    return get


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model (converted on first use into $CBSERVE_HOME, then reused)."""
    return prepare_default_model()
