"""Checksums of a DCP checkpoint: `checksums.json` records the size and CRC32 of every file DCP wrote, and every load
checks the files against it before DCP reads them (DCP itself has none: a damaged shard would load silently).

Each rank hashes its own files while it writes them (`ChecksummedFileWriter`), and the checksums travel to the
coordinating rank with DCP's own gather of the write results, one entry per file: nothing is read back (the
coordinator hashes its `.metadata` as it writes it too), and beyond that manifest the coordinator's work does not grow
with the number of ranks."""

import contextlib
import json
import os
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torchtitan.components.checkpoint.safe_io import METADATA_FILE, FileWriter, describe
from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError
from torchtitan.tools.cost import Cost, Stopwatch
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import warn_once

CHECKSUMS_FILE = "checksums.json"
# Files are hashed in chunks of this size: a shard may be larger than the memory left.
_CHECKSUM_CHUNK = 16 * 2**20


def fsync_dir(folder: Path) -> None:
    """Make renames inside `folder` durable: without it a power loss may undo them."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_checksum(path: Path) -> dict[str, Any]:
    crc = 0
    size = 0
    chunk = bytearray(_CHECKSUM_CHUNK)
    view = memoryview(chunk)
    with path.open("rb", buffering=0) as f:
        while count := f.readinto(chunk):
            crc = zlib.crc32(view[:count], crc)
            size += count
    return {"size": size, "crc32": f"{crc:08x}"}


class _HashingStream:
    """A file being written, whose size and CRC32 are computed from the bytes on their way to it. DCP writes its
    files front to back (torch.save writes through a wrapper that cannot seek); a seek would void the checksum."""

    def __init__(self, stream: Any):
        self._stream = stream
        self._crc = 0
        self._size = 0
        self._sequential = True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._crc = zlib.crc32(view, self._crc)
        self._size += view.nbytes
        return self._stream.write(data)

    def seek(self, *args: Any) -> int:
        self._sequential = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def checksum(self) -> dict[str, Any] | None:
        return {"size": self._size, "crc32": f"{self._crc:08x}"} if self._sequential else None


class _HashingFileSystem(FileSystem):
    """DCP's file system, hashing every file written through it (by name, in `checksums`)."""

    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, dict[str, Any] | None] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        self.checksums[Path(path).name] = hashing.checksum()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP writes `.metadata` under a temporary name and renames it: its checksum follows it.
        super().rename(path, new_path)
        if Path(path).name in self.checksums:
            self.checksums[Path(new_path).name] = self.checksums.pop(Path(path).name)


# The key of the extra write result in which a rank hands its files' checksums to the coordinator.
_CHECKSUMS_RESULT = MetadataIndex("__checksums__")


class ChecksummedFileWriter(FileWriter):
    """DCP's file writer that also writes `CHECKSUMS_FILE`: each rank hashes the files it writes as it writes them
    and adds their checksums to the write results that DCP gathers on the coordinator, which writes the manifest
    after `.metadata`. Within the DCP save, so in every async mode too (in the checkpoint process of
    `async_with_pinned_mem`)."""

    def __init__(self, path: str | os.PathLike, collective_timeout_s: float | None = None) -> None:
        super().__init__(path)
        # `collective_timeout_s` bounds the save's collectives in the checkpoint process of async_with_pinned_mem,
        # which runs this writer (a pickled copy) and DCP on a gloo group of its own that torch starts with its
        # 30-minute default; the process it was created in passes a group with the checkpoint timeout to DCP.
        self._collective_timeout_s = collective_timeout_s
        self._created_in_pid = os.getpid()
        self.fs = _HashingFileSystem()
        # What this rank wrote, and on the coordinator what writing DCP's `.metadata` and then the manifest cost
        # (for the save's cost; None where this process did not write them).
        self.written_bytes = 0
        self.metadata_cost: Cost | None = None
        self.manifest_cost: Cost | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        # DCP's save calls this first, before any collective of the save.
        super().reset(checkpoint_id)
        set_timeout = torch_compat.lookup("set_pg_timeout")
        if self._collective_timeout_s is not None and os.getpid() != self._created_in_pid and dist.is_initialized() \
                and set_timeout is not None:
            set_timeout(timedelta(seconds=self._collective_timeout_s))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        folder = Path(self.path)
        checksums = {}
        for name in sorted({result.storage_data.relative_path for result in results}):
            # A file written out of order (never seen with DCP's writer) is read back instead.
            checksums[name] = self.fs.checksums.get(name) or _file_checksum(folder / name)
        self.written_bytes = sum(checksum["size"] for checksum in checksums.values())
        written: Future[list[WriteResult]] = Future()
        written.set_result([*results, WriteResult(index=_CHECKSUMS_RESULT, size_in_bytes=0, storage_data=checksums)])
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        checksums: dict[str, dict[str, Any]] = {}
        for rank_results in results:
            # Each rank's checksums are the last of its write results (`write_data` appends them): taken out in
            # place, without a pass over every rank's entries, before DCP indexes the rest into `.metadata`.
            entry = rank_results.pop()
            if entry.index != _CHECKSUMS_RESULT:
                raise RuntimeError("DCP reordered a rank's write results: the checksums are not the last one")
            checksums.update(entry.storage_data)
        watch = Stopwatch()
        super().finish(metadata, results)
        self.metadata_cost = watch.cost()
        watch = Stopwatch()
        folder = Path(self.path)
        checksums[METADATA_FILE] = self.fs.checksums.get(METADATA_FILE) or _file_checksum(folder / METADATA_FILE)
        write_checksums(folder, checksums)
        self.manifest_cost = watch.cost()


def write_checksums(folder: Path, checksums: dict[str, dict[str, Any]]) -> None:
    """Write `CHECKSUMS_FILE` into the folder about to be published, whole and durable before the rename that
    publishes it: a complete checkpoint without its manifest would load unchecked."""
    with atomic_write(folder / CHECKSUMS_FILE) as f:
        json.dump({"algorithm": "crc32", "files": dict(sorted(checksums.items()))}, f, indent=1)
    fsync_dir(folder)


def _read_checksums(checkpoint: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's entries, or None (with a warning) for a checkpoint written without one."""
    path = checkpoint / CHECKSUMS_FILE
    if not path.is_file():
        warn_once(f"checkpoint {checkpoint} has no {CHECKSUMS_FILE} (saved by an older version or another tool): its "
                  f"files are loaded without an integrity check")
        return None
    try:
        files = json.loads(path.read_text())["files"]
        # Plain names only: a crafted manifest must not make the check read files elsewhere (or /dev/zero, forever).
        if not all(Path(name).name == name and name not in ("", ".", "..") and isinstance(entry, dict)
                   and entry.keys() == {"size", "crc32"} for name, entry in files.items()):
            raise ValueError("an entry is not a plain file name with its size and crc32")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"checkpoint {checkpoint} cannot be loaded (corrupt): {path} cannot be read "
                        f"({describe(err)})") from err
    return files


def _mismatch(checkpoint: Path, name: str, expected: dict[str, Any]) -> str | None:
    """How the file differs from its manifest entry, or None if it matches."""
    path = checkpoint / name
    try:
        actual = _file_checksum(path)
    except OSError as err:
        return f"{path} cannot be read ({describe(err)})"
    if actual == expected:
        return None
    return (f"{path} has {actual['size']} bytes with CRC32 {actual['crc32']}, but {CHECKSUMS_FILE} records "
            f"{expected['size']} bytes with CRC32 {expected['crc32']}")


def verify_checkpoint(checkpoint: Path, distributed: bool = False, group: dist.ProcessGroup | None = None) -> None:
    """Check the files of a DCP checkpoint against its `CHECKSUMS_FILE` before DCP reads them: a UserError names the
    first damaged file with its recorded and actual size and CRC32. With `distributed`, every rank of the default
    process group calls it and reads every W-th file (the files are on a file system that every rank sees, as DCP
    requires), so that no rank reads the whole checkpoint, and every rank raises the same error."""
    expected = _read_checksums(checkpoint)
    if expected is None:
        return
    names = sorted(expected)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed and dist.is_initialized() else (0, 1)
    first: tuple[int, str] | None = None
    for index in range(rank, len(names), world_size):
        if (problem := _mismatch(checkpoint, names[index], expected[names[index]])) is not None:
            first = (index, problem)
            break
    if world_size > 1:
        outcomes: list[tuple[int, str] | None] = [None] * world_size
        dist.all_gather_object(outcomes, first, group=group)
        first = min((outcome for outcome in outcomes if outcome is not None), default=None)
    if first is not None:
        raise UserError(f"checkpoint {checkpoint} cannot be loaded (corrupt): {first[1]}; the file changed after the "
                        f"checkpoint was saved")

