"""Reads of token-shard windows run ahead of the training loop on background threads (`training.num_workers`).

A read is a copy out of a memory map: on a cold page cache or a network file system it waits for the disk, and
numpy's copy does that waiting with the GIL released, so threads overlap the waits of several reads with each other
and with the training step. (Processes would have to send every window back through a pipe: measured slower in
docs/performance.md.)

Results are delivered in the order the reads were planned, whatever the order the threads finish them in, so the
samples are the same as with reads in the training thread. A read that fails raises its error where the consumer
reaches that read, as it would have without threads. The reads planned beyond the one consumed are only a cache:
the dataset's checkpointed position counts what was consumed, and `stop()` (or the end of the iteration) cancels
the reads not yet begun and waits for the ones running, so no thread outlives its iteration.
"""

import itertools
import sys
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")

THREAD_NAME = "shard-reader"

# A read planned as (call, in_background): a read that is not in the background (a source that must be read in
# order, in the training thread) is made when the consumer reaches it.
Read = tuple[Callable[[], T], bool]


class ReadAhead(Generic[T]):
    """Delivers the results of planned reads in order, running up to `depth` of them ahead on `threads` threads
    (with 0 threads every read is made when the consumer reaches it)."""

    def __init__(self, threads: int, depth: int) -> None:
        self.threads = threads
        self.depth = max(depth, threads)
        self._live: Generator[T, None, None] | None = None

    def run(self, reads: Iterator[Read]) -> Generator[T, None, None]:
        """The results of `reads`; stops the previous run of this object first (one live run at a time). Close the
        returned generator when done with it: that stops its threads."""
        self.stop()
        self._live = self._results(reads) if self.threads else (read() for read, _ in reads)
        return self._live

    def stop(self) -> None:
        """Ends the live run: its pending reads are dropped, its threads gone when this returns."""
        if self._live is not None:
            self._live.close()
            self._live = None

    def _results(self, reads: Iterator[Read]) -> Iterator[T]:
        executor = ThreadPoolExecutor(self.threads, thread_name_prefix=THREAD_NAME)
        pending: deque[Future | Callable[[], T]] = deque()

        def plan(count: int) -> None:
            for read, in_background in itertools.islice(reads, count):
                pending.append(executor.submit(read) if in_background else read)

        try:
            plan(self.depth)
            while pending:
                item = pending.popleft()
                plan(1)
                yield item.result() if isinstance(item, Future) else item()
        finally:
            # A run still alive when the interpreter exits ends in its teardown: concurrent.futures' exit handler has
            # joined the threads by then, and what shutdown() needs may already be torn down.
            if not sys.is_finalizing():
                executor.shutdown(wait=True, cancel_futures=True)
