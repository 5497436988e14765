"""Where token-shard windows were read: by the reader threads of training.num_workers, or by the training thread."""

import threading

import pytest

from torchtitan.components.datasets.read_ahead import THREAD_NAME
from torchtitan.components.datasets.shards import TokenShards


def record_reading_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the threads that read windows from now to the end of the test (filled as they read)."""
    names: set[str] = set()
    read = TokenShards.read

    def recording_read(self, start, length):
        names.add(threading.current_thread().name)
        return read(self, start, length)

    monkeypatch.setattr(TokenShards, "read", recording_read)
    return names


def read_where_expected(names: set[str], num_workers: int) -> bool:
    """Whether the windows were read by reader threads only (num_workers > 0) or by this thread only (0)."""
    return bool(names) and {name.startswith(THREAD_NAME) for name in names} == {num_workers > 0}


def live_reader_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(THREAD_NAME)]
