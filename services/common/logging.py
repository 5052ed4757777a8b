"""structlog set-up shared by every process: JSON lines on stderr (stdout stays for program output)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: int = logging.INFO, json: bool = True) -> None:
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
