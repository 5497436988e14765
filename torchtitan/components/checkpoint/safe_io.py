"""Reading and writing DCP checkpoints safely: `.metadata` and non-tensor entries are unpickled from an allowlist
(never running code from a crafted file), storage errors surface as themselves, and errors read as one line."""

import contextlib
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torchtitan.components.checkpoint.hf_folder import is_hf_folder
from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError

METADATA_FILE = ".metadata"


def set_element(root: dict, path: tuple[str | int, ...], value: Any) -> None:
    """Put `value` at `path` of a nested state dict (DCP's flattened-key path: strings index dicts, integers lists),
    making the dicts and lists on the way, as DCP nests what it loads."""
    node: Any = root
    for key, next_key in zip(path, path[1:]):
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = [] if isinstance(next_key, int) else {}
        else:
            node.setdefault(key, [] if isinstance(next_key, int) else {})
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with `weights_only=False`, which runs arbitrary code
    from a crafted checkpoint; this one unpickles them with `weights_only=True`, which accepts only tensors and
    plain containers of numbers and strings."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# Everything DCP's `.metadata` pickle is made of (FileSystemWriter, any sharding), besides torch's dtypes, layouts,
# memory formats and Size.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` from the classes it is made of and nothing else. FileSystemReader uses plain
    `pickle.load`, which calls whatever a crafted file names (os.system, ...) before any check could run."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `_MetadataUnpickler` (the tensors it already loads weights-only;
    WeightsOnlyLoadPlanner does the rest)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(Path(self.path) / METADATA_FILE, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class FileWriter(torch_compat.lookup("FileSystemWriterBase") or FileSystemWriter):
    """DCP's file writer (without the staging that FileSystemWriter adds where torch lets it be left out: async saves
    stage with their own stager),
    raising the OSError of a failed write itself. When the disk fills under torch.save, closing its zip writer fails
    in turn with a RuntimeError ("unexpected pos ...") that hides the OSError, and DCP hands errors between ranks
    without what they were raised while handling: a full disk would end the run with that RuntimeError's traceback
    instead of a storage error."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return super().write_data(plan, planner)
        except RuntimeError as err:
            if isinstance(err.__context__, OSError):
                raise err.__context__ from None
            raise


def serialize(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def deserialize(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def describe(err: BaseException) -> str:
    """The error in one line per failing rank, instead of the tracebacks that CheckpointException prints."""
    if isinstance(err, CheckpointException):
        return "; ".join(f"rank {rank}: {describe(failure[0])}" for rank, failure in sorted(err.failures.items()))
    return f"{type(err).__name__}: {err}"


def is_storage_error(err: BaseException) -> bool:
    """An OSError (disk full, permissions, I/O), also one raised on any rank inside a DCP collective."""
    if isinstance(err, OSError):
        return True
    if isinstance(err, CheckpointException):
        return any(isinstance(failure[0], OSError) for failure in err.failures.values())
    return False


def read_metadata(checkpoint: Path) -> Metadata:
    """DCP's metadata of a checkpoint folder, with a UserError naming the folder if it is missing or unreadable."""
    if not checkpoint.is_dir():
        raise UserError(f"checkpoint folder {checkpoint} does not exist")
    if not (checkpoint / METADATA_FILE).is_file():
        hint = ("; it is a Hugging Face folder: set checkpoint.initial_load_in_hf" if is_hf_folder(checkpoint)
                else "; the folder is incomplete or corrupt")
        raise UserError(f"checkpoint {checkpoint} has no {METADATA_FILE} file{hint}")
    try:
        return SafeFileSystemReader(checkpoint).read_metadata()
    except Exception as err:  # a truncated or foreign file fails in pickle with any of several exception types
        raise UserError(f"checkpoint {checkpoint}: {METADATA_FILE} cannot be read ({type(err).__name__}: {err}); "
                        f"the checkpoint is corrupt") from err


def dcp_load(state_dict: dict[str, Any], checkpoint: Path, no_dist: bool = False,
             process_group: dist.ProcessGroup | None = None) -> None:
    try:
        dcp.load(state_dict, checkpoint_id=checkpoint, storage_reader=SafeFileSystemReader(checkpoint),
                 planner=WeightsOnlyLoadPlanner(), no_dist=no_dist, process_group=process_group)
    except (CheckpointException, OSError, RuntimeError) as err:
        raise UserError(f"checkpoint {checkpoint} cannot be loaded (corrupt, truncated, or of another setup): "
                        f"{describe(err)}") from err


@contextlib.contextmanager
def without_collectives():
    """DCP warns each time it runs in one process without collectives, which is the intent inside this block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

