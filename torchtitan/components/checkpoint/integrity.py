"""Checksums of a DCP checkpoint: `checksums.json` records the size and CRC32 of every file DCP wrote, and every load
checks the files against it before DCP reads them (DCP itself has none: a damaged shard would load silently)."""

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchtitan.components.checkpoint.safe_io import METADATA_FILE, describe
from torchtitan.errors import UserError
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


def saved_files(folder: Path) -> list[str]:
    """The files DCP wrote into `folder` (`.metadata` and the `.distcp` shards), sorted by name."""
    return sorted(entry.name for entry in folder.iterdir()
                  if entry.is_file() and (entry.name == METADATA_FILE or entry.suffix == ".distcp"))


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


def checksum_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: _file_checksum(folder / name) for name in names}


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


def verify_checkpoint(checkpoint: Path, distributed: bool = False) -> None:
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
        dist.all_gather_object(outcomes, first)
        first = min((outcome for outcome in outcomes if outcome is not None), default=None)
    if first is not None:
        raise UserError(f"checkpoint {checkpoint} cannot be loaded (corrupt): {first[1]}; the file changed after the "
                        f"checkpoint was saved")

