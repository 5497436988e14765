"""Rank-aware logging: every line is prefixed with the rank (once), and warnings can be issued once.

Under `torchtitan.launch` with `--tee`, torchrun copies each worker's output to the console line by line with its own
prefix: the launcher then makes that prefix `[rankN] ` (the global rank) and tells the workers, through
LAUNCHER_PREFIXES_RANK_ENV, to leave it out of their lines; it also tells them through CONSOLE_IS_TTY_ENV whether
that console is a terminal, since a worker's own stderr is then a log file.
"""

import logging
import os
import sys

logger = logging.getLogger("torchtitan")

_warned: set[str] = set()

LAUNCHER_PREFIXES_RANK_ENV = "TORCHTITAN_LAUNCHER_PREFIXES_RANK"
CONSOLE_IS_TTY_ENV = "TORCHTITAN_CONSOLE_IS_TTY"


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
    """Configure the `torchtitan` logger to print `[rankN] time level message` lines to stderr (without the rank
    when the launcher already prefixes every line with it)."""
    prefix = "" if os.environ.get(LAUNCHER_PREFIXES_RANK_ENV) == "1" else f"[rank{os.environ.get('RANK', '0')}] "
    handler = _CurrentStderrHandler()
    handler.setFormatter(logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


class _KnownThirdPartyNoise(logging.Filter):
    """Drops third-party log lines that are known and harmless here (listed in docs/debugging.md), and nothing else:
    - torchao's "Failed to load .../_C_cutlass_90a.abi3.so" (and its other CUDA kernel libraries) on a CPU build of
      torch, where those libraries cannot load; on a CUDA build the same line is a real problem and is kept;
    - torch's pytree deprecation notice about torchao registering its Enum classes (`KernelPreference`,
      `ScaleCalculationMode`) as constants, which torchao does at import and no user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name.startswith("torchao") and message.startswith("Failed to load "):
            import torch  # already imported: torchao is logging

            return torch.version.cuda is not None
        if record.name == "torch.utils._pytree" and "is an Enum subclass" in message and record.args:
            return not getattr(record.args[0], "__module__", "").startswith("torchao")
        return True


def filter_known_third_party_noise() -> None:
    """Install the filter on the loggers it concerns (before they are imported: a filter on a logger holds from
    its first line on)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger_ = logging.getLogger(name)
        if not any(isinstance(existing, _KnownThirdPartyNoise) for existing in logger_.filters):
            logger_.addFilter(_KnownThirdPartyNoise())


def warn_once(message: str) -> None:
    """Log `message` as a warning the first time it is seen in this process, and never again."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def console_has_color() -> bool:
    """Whether log lines may carry ANSI colours: only when they reach a terminal, and never with NO_COLOR set
    (https://no-color.org). Colour codes in a log file or a pipe are noise."""
    if os.environ.get("NO_COLOR"):
        return False
    launcher_console = os.environ.get(CONSOLE_IS_TTY_ENV)
    if launcher_console is not None:
        return launcher_console == "1"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())
