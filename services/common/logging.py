"""structlog set-up shared by every process: JSON lines on stderr (stdout stays for program output)."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """`sys.stderr` as it is at each write, not as it was at set-up: code that runs `cbserve` in
    process (the tests, an embedding program) may swap stderr and close the old one."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: int = logging.INFO, json: bool = True) -> None:
    stderr = _CurrentStderr()
    logging.basicConfig(level=level, stream=stderr, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=stderr),
        cache_logger_on_first_use=True,
    )
