"""Writing a file whole or not at all, and where this project caches what it measured or built once."""

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_args) -> Iterator[IO]:
    """Open a temporary file beside `path` and rename it onto `path` once the block completes and the file is on
    disk (fsync): a crash, a full disk or a concurrent writer (ranks writing the same file) never leaves a
    half-written `path`, and a failed block leaves what was there before."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **open_args) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/torchtitan` (default `~/.cache/torchtitan`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchtitan"
