"""Two benchmark processes that take turns, one training step each, so that a machine whose speed drifts slows both
alike (docs/performance.md): the way to compare systems that cannot share a process.

Each process is given two FIFOs, `MINE:THEIRS`. Before a step it waits for a byte on MINE; after the step it writes
one to THEIRS. Both are opened read-write, which on Linux neither blocks on open nor raises SIGPIPE once the other
process has exited. This module imports nothing of this project, so TorchTitan's environment can use it too.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Callable, Iterator
from pathlib import Path


class Turns:
    """`turn()` holds the machine for one step; a no-op without FIFOs. While it waits it checks `other_alive` every
    second, and raises if the other process has gone (it would never give the turn back)."""

    def __init__(self, spec: str | None = None, other_alive: Callable[[], bool] = lambda: True) -> None:
        self._mine = self._theirs = None
        self._other_alive = other_alive
        if spec:
            mine, sep, theirs = spec.partition(":")
            if not sep or not Path(mine).is_fifo() or not Path(theirs).is_fifo():
                raise ValueError(f"--turns {spec!r}: expected MINE:THEIRS, two FIFOs (os.mkfifo)")
            self._mine, self._theirs = os.open(mine, os.O_RDWR), os.open(theirs, os.O_RDWR)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        if self._mine is None:
            yield
            return
        self.wait()
        try:
            yield
        finally:
            self.pass_turn()

    def wait(self) -> None:
        """Wait for this process's turn. Alone, as the last call, it keeps what follows the last step (saving
        results, shutting down) out of the other process's last step."""
        if self._mine is None:
            return
        while not select.select([self._mine], [], [], 1.0)[0]:
            if not self._other_alive():
                raise RuntimeError("the process this one takes turns with has exited")
        os.read(self._mine, 1)

    def pass_turn(self) -> None:
        """Let the other process step (the process that is to wait first calls this once, before its first step)."""
        if self._theirs is not None:
            os.write(self._theirs, b"t")


def make_fifos(folder: Path, *names: str) -> list[Path]:
    paths = [folder / name for name in names]
    for path in paths:
        os.mkfifo(path)
    return paths
