"""Rank-aware logging: every line is prefixed with the rank, and warnings can be issued once."""

import logging
import os
import sys

logger = logging.getLogger("torchtitan")

_warned: set[str] = set()


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged, not the stream it was when the logger was set up
    (tools and tests replace it, and an old one may have been closed since). Logs go to stderr so that a script's
    own output (generated text, a table) is alone on stdout."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def init_logger(level: int = logging.INFO) -> None:
    """Configure the `torchtitan` logger to print `[rank N] time level message` lines to stderr."""
    rank = os.environ.get("RANK", "0")
    handler = _CurrentStderrHandler()
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
