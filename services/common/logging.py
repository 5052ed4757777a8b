"""structlog set-up shared by every process: JSON lines on stderr (stdout stays for program output).

Every line names the process that wrote it (`service`: gateway, worker, cachemgr, supervisor, ...)
and its `pid`, because `cbserve up` interleaves three processes' lines on one stream.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog


class _CurrentStderr:
    """`sys.stderr` as it is at each write, not as it was at set-up: code that runs `cbserve` in
    process (the tests, an embedding program) may swap stderr and close the old one."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _process_fields(service: str) -> structlog.types.Processor:
    def add(logger: Any, method: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
        event.setdefault("service", service)
        event.setdefault("pid", os.getpid())
        return event

    return add


def disable_progress_bars() -> None:
    """No tqdm bars (transformers' "Loading weights", the model conversion): on a log stream their
    carriage returns break lines, and in JSON logs a bar is a line no parser reads. The variables
    reach libraries imported later and this process's children."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"
    if "transformers" in sys.modules:  # already imported: its switch was read at import
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def configure_logging(level: int = logging.INFO, json: bool = True, service: str = "cbserve") -> None:
    stderr = _CurrentStderr()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    fields: list[structlog.types.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        _process_fields(service),
    ]
    # Lines of the standard `logging` module (ours and libraries') take the same form as structlog's.
    handler = logging.StreamHandler(stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=fields,
        )
    )
    logging.basicConfig(level=level, handlers=[handler])
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *fields, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write a line: `print` writes the line, then its newline, in two, and stderr sends each
        # straight to the file that `cbserve up`'s processes share, so lines of two processes could
        # merge into one that no JSON parser reads, followed by an empty one (seen in CI).
        # structlog annotates `file` as TextIO, but WriteLogger only calls its write and flush.
        logger_factory=structlog.WriteLoggerFactory(file=stderr),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
