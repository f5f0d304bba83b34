"""Structured, quiet-by-default logging: one `key=value` line per event on stderr, the libraries'
records (aiohttp, asyncio, Python warnings) in the same format, at warning and above. (Ray's
logger keeps a handler and format of its own.)"""

from __future__ import annotations

import logging
import sys
import time


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} logger={record.name} " \
               f"msg={record.getMessage()!r}"
        for key, value in getattr(record, "fields", {}).items():
            line += f" {key}={value!r}" if isinstance(value, str) else f" {key}={value}"
        if record.exc_info and record.exc_info[1] is not None:  # (on the same line: one line an event)
            exc = record.exc_info[1]
            line += f" exception={f'{type(exc).__name__}: {exc}'!r} traceback={self.formatException(record.exc_info)!r}"
        return line


class _ClientsMalformedRequests(logging.Filter):
    """aiohttp's server logs every malformed HTTP request a client sends (bad framing, a bad header) as
    an error with its traceback: the client's fault, which any client could make fill the log. Kept
    for --log-level debug."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__module__ == "aiohttp.http_exceptions":
            return logging.getLogger("moemesh").isEnabledFor(logging.DEBUG)
        return True


def setup_logging(level: str = "warning") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    handler.addFilter(_ClientsMalformedRequests())
    handler.moemesh = True  # (the one to replace when called again; others' handlers, a test's, stay)
    ours = logging.getLogger("moemesh")
    ours.handlers[:] = [handler]
    ours.setLevel(level.upper())
    ours.propagate = False
    root = logging.getLogger()  # every other logger: warnings and errors, in the same format
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "moemesh", False)] + [handler]
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"moemesh.{name}")
