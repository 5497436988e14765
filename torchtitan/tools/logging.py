"""Rank-aware logging: every line is prefixed with the rank, and warnings can be issued once."""

import logging
import os
import sys

logger = logging.getLogger("torchtitan")

_warned: set[str] = set()


class _CurrentStdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is when a line is logged, not the stream it was when the logger was set up
    (tools and tests replace sys.stdout, and an old one may have been closed since)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def init_logger(level: int = logging.INFO) -> None:
    """Configure the `torchtitan` logger to print `[rank N] time level message` lines to stdout."""
    rank = os.environ.get("RANK", "0")
    handler = _CurrentStdoutHandler()
    handler.setFormatter(
        logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def warn_once(message: str) -> None:
    """Log `message` as a warning the first time it is seen in this process, and never again."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
