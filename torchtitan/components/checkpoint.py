"""Saving and resuming the whole training state with torch.distributed.checkpoint (DCP).

Layout under `<dump_folder>/<checkpoint.folder>`:

    step-N/                  a complete checkpoint: DCP files (`.metadata`, `__R_I.distcp`) and `checksums.json`,
                             or, for a last save with `last_save_in_hf`, a Hugging Face folder (`config.json`,
                             `model.safetensors`)
    step-N.incomplete/       being written, or left behind by a crash: never loaded, removed by the next save

Every save is written into `step-N.incomplete`; only once DCP has finished on every rank does rank 0 rename it to
`step-N` (an atomic rename), so a folder named `step-N` is always complete, whenever a process dies. If `step-N`
already exists (a run resumed from an earlier step reaches the same step again), the new checkpoint replaces it once
the new one is complete: the old folder is renamed to `step-N.stale.incomplete`, the new one into place, and the old
one deleted. A crash between those renames leaves both under `.incomplete` names, and resuming takes the previous
complete step.

Rank 0 also writes `model.json` into every DCP checkpoint: the model's shape (width, layers, heads, FFN width,
vocabulary, RoPE), which `[model]` may have set on top of the flavor. Loading a checkpoint (resume or
`initial_load_path`) compares it with this run's model first, and names the options that differ: the parameter shapes
do not reveal the head count or the RoPE base, which would load silently and compute something else.

DCP has no checksums: a shard damaged after the save (other bytes, same size) would load silently. So before the
rename rank 0 writes `checksums.json` into the folder, the size and CRC32 of every file DCP wrote, and every load
checks the files against it before DCP reads them; a checkpoint without one (an older version's, or another tool's)
loads unchecked, with a warning.

Once a new checkpoint is in place, rank 0 deletes what it supersedes:
- `keep_latest_k` counts only full checkpoints (those holding the train state, the only ones a resume continues
  from): the k newest are kept. A model-only checkpoint never evicts a full one; it is deleted once it is older than
  every full checkpoint kept (it can no longer be what the run resumes from, nor its latest weights).
- A run that resumed from a step older than a full checkpoint of the folder (`load_step`, or a load without the
  train state, which restarts at step 0) continues another trajectory: the checkpoints newer than its starting step
  are retired when its first checkpoint is complete, and not before, so that a rollback run that dies early loses
  nothing. Retired means deleted, or with `keep_latest_k = 0` (keep everything) renamed to `step-N.abandoned`,
  which no resume considers. Otherwise a later plain restart would resume the abandoned trajectory.

Keys of a DCP checkpoint (DCP joins nested keys with dots):

    model.<parameter name>       full names, whatever the sharding or pipeline split, so any layout reloads them
    optimizer.state.<name>.<k>   OptimizersContainer's flattened state; optimizer.param_groups.<name> packs that
                                 parameter's hyperparameters into one record
    lr_scheduler.last_epoch
    dataloader                   the data loader's state, serialised into one value under one key for all ranks:
                                 DCP writes it once, every rank loads it (any rank's position resumes every rank,
                                 also with another number of ranks), and its structure may change as iteration
                                 starts without breaking the load
    train_state.step, train_state.tokens_seen
    rng_rank<R>.python/.torch/.cuda   each rank's random generators, restored only on a rank that has an entry

Model-only checkpoints (the seed checkpoint, `last_save_model_only`) hold only `model.*`. Resuming picks the latest
checkpoint that holds the train state; only when there is none does it load a model-only one (the model, with the
rest as initialised).
"""

import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.state_dict_adapter import is_hf_folder, load_hf, save_hf
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import logger, warn_once

INCOMPLETE_SUFFIX = ".incomplete"
METADATA_FILE = ".metadata"
CHECKSUMS_FILE = "checksums.json"
MODEL_FILE = "model.json"
# Files are hashed in chunks of this size: a shard may be larger than the memory left.
_CHECKSUM_CHUNK = 16 * 2**20
LOADABLE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


@dataclass
class TrainState(Stateful):
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen = int(state_dict["tokens_seen"])


class ModelWrapper(Stateful):
    """The model parts (pipeline stages on this rank) as one state dict keyed by full parameter names."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        return {name: value for part in self.model_parts for name, value in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.model_parts:
            # strict=False: each part takes its own parameters from the merged dict. A copy per part because
            # set_model_state_dict may pop entries from the dict it is given.
            set_model_state_dict(part, dict(state_dict), options=StateDictOptions(strict=False))


class RNGState(Stateful):
    """This process's random generators: Python's `random`, torch's CPU generator and, if present, CUDA's."""

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "python" in state_dict:
            random.setstate(state_dict["python"])
        if "torch" in state_dict:
            torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


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


class _FileWriter(_FileSystemWriter):
    """DCP's file writer (without the staging that FileSystemWriter adds: async saves stage with their own stager),
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


def _serialize(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _deserialize(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


_PARAM_GROUPS = "param_groups."


def _pack_param_groups(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """OptimizersContainer's flat state repeats a dozen hyperparameters per parameter (`param_groups.<name>.lr`,
    ...). DCP pickles every non-tensor entry as a record of its own, about a millisecond each, so each parameter's
    hyperparameters are packed into one record, still keyed by the parameter's name so that any sharding or
    pipeline split reloads them."""
    packed: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in optimizer_state.items():
        if key.startswith(_PARAM_GROUPS):
            name, field = key.removeprefix(_PARAM_GROUPS).rsplit(".", 1)
            groups.setdefault(name, {})[field] = value
        else:
            packed[key] = value
    packed.update({_PARAM_GROUPS + name: _serialize(fields) for name, fields in groups.items()})
    return packed


def _unpack_param_groups(packed: dict[str, Any]) -> dict[str, Any]:
    optimizer_state: dict[str, Any] = {}
    for key, value in packed.items():
        if key.startswith(_PARAM_GROUPS):
            optimizer_state.update({f"{key}.{field}": v for field, v in _deserialize(value).items()})
        else:
            optimizer_state[key] = value
    return optimizer_state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _incomplete(path: Path) -> Path:
    return path.with_name(path.name + INCOMPLETE_SUFFIX)


def _fsync_dir(folder: Path) -> None:
    """Make renames inside `folder` durable: without it a power loss may undo them."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(err: BaseException) -> str:
    """The error in one line per failing rank, instead of the tracebacks that CheckpointException prints."""
    if isinstance(err, CheckpointException):
        return "; ".join(f"rank {rank}: {_describe(failure[0])}" for rank, failure in sorted(err.failures.items()))
    return f"{type(err).__name__}: {err}"


def _is_storage_error(err: BaseException) -> bool:
    """An OSError (disk full, permissions, I/O), also one raised on any rank inside a DCP collective."""
    if isinstance(err, OSError):
        return True
    if isinstance(err, CheckpointException):
        return any(isinstance(failure[0], OSError) for failure in err.failures.values())
    return False


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint (`step-N` folders) in `folder`, ascending."""
    if not folder.is_dir():
        return []
    steps = [int(m.group(1)) for entry in folder.iterdir() if entry.is_dir() and (m := _STEP_FOLDER.match(entry.name))]
    return sorted(steps)


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


def _saved_files(folder: Path) -> list[str]:
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


def _checksum_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: _file_checksum(folder / name) for name in names}


def _write_checksums(folder: Path, checksums: dict[str, dict[str, Any]]) -> None:
    """Write `CHECKSUMS_FILE` into the folder about to be published, whole and durable before the rename that
    publishes it: a complete checkpoint without its manifest would load unchecked."""
    with atomic_write(folder / CHECKSUMS_FILE) as f:
        json.dump({"algorithm": "crc32", "files": dict(sorted(checksums.items()))}, f, indent=1)
    _fsync_dir(folder)


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
                        f"({_describe(err)})") from err
    return files


def _mismatch(checkpoint: Path, name: str, expected: dict[str, Any]) -> str | None:
    """How the file differs from its manifest entry, or None if it matches."""
    path = checkpoint / name
    try:
        actual = _file_checksum(path)
    except OSError as err:
        return f"{path} cannot be read ({_describe(err)})"
    if actual == expected:
        return None
    return (f"{path} has {actual['size']} bytes with CRC32 {actual['crc32']}, but {CHECKSUMS_FILE} records "
            f"{expected['size']} bytes with CRC32 {expected['crc32']}")


def _model_shape(model_args: TransformerModelArgs) -> dict[str, Any]:
    """What `MODEL_FILE` records: every value that decides what the weights compute, named as the model.* options
    (the SwiGLU width both as its options and as the width they give, which is what is compared)."""
    return {"dim": model_args.dim, "n_layers": model_args.n_layers, "n_heads": model_args.n_heads,
            "n_kv_heads": model_args.kv_heads, "ffn_dim_multiplier": model_args.ffn_dim_multiplier,
            "multiple_of": model_args.multiple_of, "ffn_hidden_dim": model_args.ffn_hidden_dim,
            "vocab_size": model_args.vocab_size, "rope_theta": model_args.rope_theta, "norm_eps": model_args.norm_eps,
            "use_scaled_rope": model_args.use_scaled_rope}


def check_model_shape(checkpoint: Path, model_args: TransformerModelArgs) -> None:
    """A UserError naming every shape value in which the checkpoint's `MODEL_FILE` differs from this run's model
    (a checkpoint without one, from an older version, is left to the parameter-shape check)."""
    path = checkpoint / MODEL_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"checkpoint {checkpoint}: {path} cannot be read ({_describe(err)})") from err
    ours = _model_shape(model_args)
    differ = [name for name in ours if name in saved and saved[name] != ours[name]
              and name not in ("ffn_dim_multiplier", "multiple_of")]
    if differ:
        raise UserError(f"checkpoint {checkpoint} was saved from another model: "
                        + ", ".join(f"{name} {saved[name]} (this run: {ours[name]})" for name in differ)
                        + "; set model.flavor and the [model] shape options it was trained with (its shape is in "
                        f"{path})")


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


def _dcp_load(state_dict: dict[str, Any], checkpoint: Path, no_dist: bool = False) -> None:
    try:
        dcp.load(state_dict, checkpoint_id=checkpoint, storage_reader=SafeFileSystemReader(checkpoint),
                 planner=WeightsOnlyLoadPlanner(), no_dist=no_dist)
    except (CheckpointException, OSError, RuntimeError) as err:
        raise UserError(f"checkpoint {checkpoint} cannot be loaded (corrupt, truncated, or of another setup): "
                        f"{_describe(err)}") from err


def read_full_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint, unsharded, in this process alone: the optimizer's hyperparameters and the
    data loader's state unpacked into plain values, as the trainer restores them."""
    metadata = read_metadata(checkpoint)
    verify_checkpoint(checkpoint)
    # The template DCP loads into, nested as saved: tensors of the saved shapes, placeholders for the rest.
    state_dict: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        value = (torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                 if isinstance(entry, TensorStorageMetadata) else b"")
        set_element(state_dict, (metadata.planner_data or {}).get(key, (key,)), value)
    with without_collectives():
        _dcp_load(state_dict, checkpoint, no_dist=True)
    if "optimizer" in state_dict:
        state_dict["optimizer"] = _unpack_param_groups(state_dict["optimizer"])
    if isinstance(state_dict.get("dataloader"), bytes):
        state_dict["dataloader"] = _deserialize(state_dict["dataloader"])
    return state_dict


@contextlib.contextmanager
def without_collectives():
    """DCP warns each time it runs in one process without collectives, which is the intent inside this block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_full_model(checkpoint: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of a DCP checkpoint, unsharded, on CPU, in this process alone (no collectives).
    `verify=False` skips the check against `CHECKSUMS_FILE`, for a folder this job has just written without one."""
    metadata = read_metadata(checkpoint)
    if verify:
        verify_checkpoint(checkpoint)
    prefix = "model."
    state_dict = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                  for key, entry in metadata.state_dict_metadata.items()
                  if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    if not state_dict:
        raise UserError(f"checkpoint {checkpoint} holds no model weights (no 'model.*' entries)")
    with without_collectives():
        _dcp_load(state_dict, checkpoint, no_dist=True)
    return {key.removeprefix(prefix): tensor for key, tensor in state_dict.items()}


def validate_config(config: CheckpointConfig) -> None:
    if config.interval < 1:
        raise UserError(f"option checkpoint.interval: {config.interval} must be at least 1")
    if config.keep_latest_k < 0:
        raise UserError(f"option checkpoint.keep_latest_k: {config.keep_latest_k} must be 0 (keep all) or more")
    if config.load_step < -1:
        raise UserError(f"option checkpoint.load_step: {config.load_step} must be -1 (latest) or a step")
    if config.async_mode not in ASYNC_MODES:
        raise UserError(f"option checkpoint.async_mode: {config.async_mode!r} is not one of {', '.join(ASYNC_MODES)}")
    if config.export_dtype not in EXPORT_DTYPES:
        raise UserError(f"option checkpoint.export_dtype: {config.export_dtype!r} is not one of "
                        f"{', '.join(EXPORT_DTYPES)}")
    unknown = [part for part in config.exclude_from_loading if part not in LOADABLE_PARTS]
    if unknown:
        raise UserError(f"option checkpoint.exclude_from_loading: {', '.join(map(repr, unknown))} is not one of "
                        f"{', '.join(LOADABLE_PARTS)}")
    if config.create_seed_checkpoint and not config.enable:
        raise UserError("option checkpoint.create_seed_checkpoint: it needs checkpoint.enable = true")


@dataclass
class _PendingSave:
    completion: Future
    step: int
    staging: Path


class CheckpointManager:
    """Saves the training state every `interval` steps and resumes from the latest complete checkpoint.

    Every rank constructs one and calls `load`, `save` and `close` at the same points (they run collectives).
    Async modes need an initialised process group (the trainer always has one, possibly of size 1).
    """

    def __init__(self, config: CheckpointConfig, dump_folder: str, model_parts: list[nn.Module],
                 optimizers: Stateful, lr_schedulers: Stateful, dataloader: Stateful, train_state: TrainState,
                 model_args: TransformerModelArgs):
        validate_config(config)
        self.config = config
        self.folder = Path(dump_folder) / config.folder
        self.model = ModelWrapper(model_parts)
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.train_state = train_state
        self.rng = RNGState()
        self.model_args = model_args
        self.rank = _rank()
        self.rng_key = f"rng_rank{self.rank}"
        self._pending: _PendingSave | None = None
        # Steps of another trajectory, newer than the one this run resumed from: retired at its first publish.
        self._abandoned: list[int] = []
        # How long each save of this run kept the training loop waiting (seconds, in order), for measurements.
        self.blocked_s: list[float] = []
        self._async_group = None
        self._stager: DefaultStager | None = None
        if config.enable and not config.load_only and config.async_mode != "disabled":
            # Background saves coordinate over their own gloo group, so their collectives never interleave with
            # the training loop's on the default (possibly NCCL) group.
            self._async_group = dist.new_group(backend="gloo")
        if config.enable and not config.load_only and config.async_mode == "async_with_pinned_mem":
            # Staging copies into shared memory (pinned too on CUDA) that the checkpoint process reads without
            # another copy, and reuses the buffers from one save to the next. It runs synchronously in save():
            # the trainer does not wait for staging before the next optimizer step, which would change the
            # weights while they are being copied.
            on_cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=True,
                                                        use_async_staging=False, use_non_blocking_copy=False))

    # ------------------------------------------------------------------------------------------------------------
    # Loading

    def load(self) -> bool:
        """Resume from the latest complete checkpoint (or `load_step`), else start from `initial_load_path`.

        Returns whether anything was loaded.
        """
        if not self.config.enable:
            return False
        begin = time.perf_counter()
        wanted = [part for part in LOADABLE_PARTS if part not in self.config.exclude_from_loading]
        step = self._step_to_resume()
        if step is not None:
            source = self._step_path(step)
            if self.config.initial_load_path:
                logger.info(f"Resuming from {source}; checkpoint.initial_load_path is not used")
            loaded = self._load_from(source, wanted)
        elif self.config.initial_load_path:
            source = Path(self.config.initial_load_path)
            if not source.exists():
                raise UserError(f"option checkpoint.initial_load_path: {source} does not exist")
            if self.config.initial_load_in_hf:
                loaded = self._load_hf_model(source) if "model" in wanted else []
            else:
                loaded = self._load_from(source, ["model"] if self.config.initial_load_model_only else wanted)
        else:
            logger.info(f"No checkpoint in {self.folder} and no checkpoint.initial_load_path: starting from scratch")
            return False
        logger.info(f"Loaded {', '.join(loaded) or 'nothing'} from {source} in {time.perf_counter() - begin:.2f} s"
                    + (f" (step {self.train_state.step})" if "train_state" in loaded else ""))
        if step is not None and not self.config.load_only:
            self._abandoned = self._newer_trajectory(self.train_state.step)
        return bool(loaded)

    def _newer_trajectory(self, start: int) -> list[int]:
        """The complete steps after `start` if a full checkpoint is among them: this run, continuing from `start`,
        abandons them, and they must not outlive its first checkpoint, or a later resume would pick them. Newer
        model-only checkpoints alone (the last save that a default resume passed over) are the same trajectory."""
        newer = [step for step in complete_steps(self.folder) if step > start]
        if not any(self._counts_as_full(step) for step in newer):
            return []
        logger.warning(f"This run continues from step {start}, older than the checkpoints of steps "
                       f"{', '.join(map(str, newer))} in {self.folder}: they will be "
                       f"{'renamed to step-N.abandoned' if self.config.keep_latest_k == 0 else 'deleted'} once this "
                       f"run's first checkpoint is complete, so that a later resume continues this run")
        return newer

    def _step_path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def _step_to_resume(self) -> int | None:
        steps = complete_steps(self.folder)
        if self.config.load_step == -1:
            # A finished run ends with a model-only save: resuming it (to train further) must start from the latest
            # checkpoint that also holds the optimizer, data position and step, not restart from step 1.
            resumable = [step for step in steps if self._holds_train_state(self._step_path(step))]
            if resumable and resumable[-1] != steps[-1]:
                logger.warning(f"Resuming from step-{resumable[-1]}, the latest full checkpoint: step-{steps[-1]} "
                               f"holds only the model weights")
            return resumable[-1] if resumable else (steps[-1] if steps else None)
        if self.config.load_step not in steps:
            available = ", ".join(map(str, steps)) or "none"
            raise UserError(f"option checkpoint.load_step: step {self.config.load_step} has no complete checkpoint "
                            f"in {self.folder}; available steps: {available}")
        return self.config.load_step

    def _holds_train_state(self, checkpoint: Path) -> bool:
        if not (checkpoint / METADATA_FILE).exists():
            # An HF export holds only weights; any other folder without metadata is damaged: loading it reports that.
            return not is_hf_folder(checkpoint)
        return self._is_saved("train_state", read_metadata(checkpoint).state_dict_metadata)

    def _load_from(self, checkpoint: Path, wanted: list[str]) -> list[str]:
        if not (checkpoint / METADATA_FILE).exists() and is_hf_folder(checkpoint):
            logger.warning(f"{checkpoint} is a Hugging Face export: it holds only the model weights")
            return self._load_hf_model(checkpoint) if "model" in wanted else []
        saved = read_metadata(checkpoint).state_dict_metadata
        verify_checkpoint(checkpoint, distributed=True)
        present = [part for part in wanted if self._is_saved(part, saved)]
        skipped = [part for part in wanted if part not in present and part != "rng"]
        if skipped:
            logger.warning(f"Checkpoint {checkpoint} holds no {', '.join(skipped)}; they keep their initial state")
        if "model" in present:
            check_model_shape(checkpoint, self.model_args)
            self._check_model_shapes(checkpoint, saved)
        state_dict = {self._key(part): self._load_template(part, saved) for part in present}
        files = list(checkpoint.glob("*.distcp"))
        logger.info(f"Loading {', '.join(present)} from {checkpoint} ({len(files)} files, "
                    f"{sum(f.stat().st_size for f in files) / 2**30:.2f} GiB)")
        _dcp_load(state_dict, checkpoint)
        for part in present:
            try:
                self._apply(part, state_dict[self._key(part)])
            except pickle.UnpicklingError as err:
                raise UserError(f"checkpoint {checkpoint}: its {part} state is refused ({_describe(err)})") from err
        return present

    def _key(self, part: str) -> str:
        return self.rng_key if part == "rng" else part

    def _is_saved(self, part: str, saved: dict[str, Any]) -> bool:
        key = self._key(part)
        return key in saved or any(name.startswith(key + ".") for name in saved)

    def _load_template(self, part: str, saved: dict[str, Any]) -> Any:
        """What DCP loads `part` into: its current state, of the shapes the checkpoint must match."""
        if part == "model":
            return self.model.state_dict()
        if part == "dataloader":
            return b""
        if part == "optimizer":
            return _pack_param_groups(self.optimizers.state_dict())
        if part == "rng":
            # Only generators saved by this rank: a CPU run's checkpoint resumes on CUDA and vice versa.
            return {name: state for name, state in self.rng.state_dict().items() if f"{self.rng_key}.{name}" in saved}
        return self._stateful(part).state_dict()

    def _stateful(self, part: str) -> Stateful:
        return {"lr_scheduler": self.lr_schedulers, "train_state": self.train_state,
                "rng": self.rng, "model": self.model}[part]

    def _apply(self, part: str, state: Any) -> None:
        if part == "dataloader":
            self.dataloader.load_state_dict(_deserialize(state))
        elif part == "optimizer":
            self.optimizers.load_state_dict(_unpack_param_groups(state))
        else:
            self._stateful(part).load_state_dict(state)

    def _check_model_shapes(self, checkpoint: Path, saved: dict[str, Any]) -> None:
        """Name the first parameter the checkpoint lacks or holds in another shape, before DCP fails obscurely."""
        for name, tensor in self.model.state_dict().items():
            entry = saved.get(f"model.{name}")
            if not isinstance(entry, TensorStorageMetadata):
                raise UserError(f"checkpoint {checkpoint} has no weight {name}: it was saved from another model; "
                                f"check model.flavor")
            if tuple(entry.size) != tuple(tensor.shape):
                raise UserError(f"checkpoint {checkpoint}: {name} was saved with shape {list(entry.size)}, the "
                                f"model expects {list(tensor.shape)}; it was saved from another model, check "
                                f"model.flavor")

    def _load_hf_model(self, folder: Path) -> list[str]:
        full_state_dict = load_hf(folder, self.model_args)
        for part in self.model.model_parts:
            # Every rank holds the full tensors; set_model_state_dict shards them into the part's DTensors.
            set_model_state_dict(part, dict(full_state_dict),
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        return ["model"]

    # ------------------------------------------------------------------------------------------------------------
    # Saving

    def save(self, step: int, last_step: bool = False, force: bool = False) -> None:
        """Checkpoint after `step` if it is due: every `interval` steps, at step 1 with
        `enable_first_step_checkpoint`, at the last step, or when `force`d (a preempted run). How long the call kept
        the training loop waiting is appended to `blocked_s` (with an async mode, waiting for the previous background
        save included)."""
        if not self._is_due(step, last_step, force):
            return
        begin = time.perf_counter()
        if last_step and self.config.last_save_in_hf:
            self._save_hf_export(step)
        elif last_step and self.config.last_save_model_only:
            dtype = EXPORT_DTYPES[self.config.export_dtype]
            self._save_dcp(step, {"model": {name: value.to(dtype) for name, value in self.model.state_dict().items()}})
        else:
            self._save_dcp(step, self._full_state())
        blocked = time.perf_counter() - begin
        self.blocked_s.append(blocked)
        logger.info(f"Checkpoint of step {step}: the training loop was blocked {blocked:.3f} s "
                    f"(async_mode {self.config.async_mode})")

    def save_seed(self, step: int = 0) -> None:
        """Write the initialised model alone as `step-<step>`, for runs that must all start from the same weights."""
        self._save_dcp(step, {"model": self.model.state_dict()})
        self._wait_for_pending_save()
        logger.info(f"Seed checkpoint written to {self._step_path(step)}")

    def close(self) -> None:
        """Wait for an outstanding background save; call before exiting."""
        self._wait_for_pending_save()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _is_due(self, step: int, last_step: bool, force: bool) -> bool:
        if not self.config.enable or self.config.load_only:
            return False
        return (last_step or force or step % self.config.interval == 0
                or (step == 1 and self.config.enable_first_step_checkpoint))

    def _full_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": _pack_param_groups(self.optimizers.state_dict()),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "dataloader": _serialize(self.dataloader.state_dict()),
            "train_state": self.train_state.state_dict(),
            self.rng_key: self.rng.state_dict(),
        }

    def _save_dcp(self, step: int, state_dict: dict[str, Any]) -> None:
        self._wait_for_pending_save()
        staging = _incomplete(self._step_path(step))
        self._on_rank0(self._remove_leftovers, f"cleaning up {self.folder} before saving step {step}")
        if self.config.async_mode == "disabled":
            try:
                dcp.save(state_dict, checkpoint_id=staging, storage_writer=_FileWriter(staging))
                checksums = self._gather_checksums(staging)
            except (Exception, CheckpointException) as err:
                self._raise_save_error(err, step, staging)
            self._on_rank0(lambda: self._publish(step, checksums), f"publishing checkpoint {staging}")
            return
        started = time.perf_counter()
        if self._stager is not None:
            upload = dcp.async_save(state_dict, checkpoint_id=staging, storage_writer=_FileWriter(staging),
                                    process_group=self._async_group,
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self._stager)
        else:
            upload = dcp.async_save(state_dict, checkpoint_id=staging, storage_writer=_FileWriter(staging),
                                    process_group=self._async_group)
        completed: Future = Future()

        def finish(upload: Future) -> None:
            # Runs in the background once this rank's part is written; on rank 0 that is after DCP gathered every
            # rank's results and wrote .metadata, so the folder is complete and may be published. The ranks'
            # callbacks run independently, in background threads, and meet in no collective (one on the default
            # group could interleave with the training loop's), so rank 0 hashes every rank's files itself, still in
            # the background: only synchronous saves share the reading among the ranks.
            try:
                upload.result()
                if self.rank == 0:
                    self._publish(step, _checksum_files(staging, _saved_files(staging)))
                logger.info(f"Checkpoint {self._step_path(step)} written in the background in "
                            f"{time.perf_counter() - started:.2f} s")
                completed.set_result(None)
            except BaseException as err:  # CheckpointException is a BaseException; it must reach the waiter
                completed.set_exception(err)

        upload.add_done_callback(finish)
        self._pending = _PendingSave(completed, step, staging)

    def _wait_for_pending_save(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.completion.result()
        except (Exception, CheckpointException) as err:
            self._raise_save_error(err, pending.step, pending.staging)

    def _raise_save_error(self, err: BaseException, step: int, staging: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if not _is_storage_error(err):
            raise err
        raise UserError(f"saving the checkpoint of step {step} into {staging} failed: {_describe(err)}; earlier "
                        f"checkpoints in {self.folder} are untouched") from err

    def _gather_checksums(self, staging: Path) -> dict[str, dict[str, Any]]:
        """Checksums of the files DCP wrote into `staging`, for `_publish` on rank 0. Every rank calls it and hashes
        every W-th file, sorted by name as rank 0 lists them (another host's view of the shared folder may lag
        behind), so that no rank reads the whole checkpoint. A rank that cannot read makes every rank raise."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return _checksum_files(staging, _saved_files(staging))
        world_size = dist.get_world_size()
        listing: list[Any] = [None]
        if self.rank == 0:
            try:
                listing = [_saved_files(staging)]
            except OSError as err:
                listing = [f"rank 0: {_describe(err)}"]
        dist.broadcast_object_list(listing, src=0)
        share = listing[0]
        if not isinstance(share, str):
            try:
                share = _checksum_files(staging, share[self.rank::world_size])
            except OSError as err:
                share = f"rank {self.rank}: {_describe(err)}"
        shares: list[Any] = [None] * world_size
        dist.all_gather_object(shares, share)
        errors = list(dict.fromkeys(share for share in shares if isinstance(share, str)))
        if errors:
            raise OSError(f"reading back the files for {CHECKSUMS_FILE} failed: {'; '.join(errors)}")
        return {name: checksum for share in shares for name, checksum in share.items()}

    def _on_rank0(self, action: Callable[[], None], what: str) -> None:
        """Run a filesystem action on rank 0 alone. The broadcast of its outcome doubles as a barrier, and makes
        every rank raise if it failed, rather than leave the others waiting in the next collective."""
        error = None
        if self.rank == 0:
            try:
                action()
            except (OSError, UserError) as err:
                error = f"{what} failed: {err}"
        if dist.is_initialized():
            outcome = [error]
            dist.broadcast_object_list(outcome, src=0)
            error = outcome[0]
        if error is not None:
            raise UserError(error)

    def _remove_leftovers(self) -> None:
        """Delete `*.incomplete` folders: interrupted saves, whose contents are never loaded."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for entry in self.folder.iterdir():
            if entry.name.endswith(INCOMPLETE_SUFFIX):
                logger.info(f"Removing {entry}, left by an interrupted save")
                shutil.rmtree(entry)

    def _publish(self, step: int, checksums: dict[str, dict[str, Any]] | None = None) -> None:
        """Rename `step-N.incomplete` to `step-N`, after writing `checksums` (of a DCP checkpoint; an HF export's
        safetensors need none) into it."""
        final = self._step_path(step)
        staging = _incomplete(final)
        if checksums is not None:
            with atomic_write(staging / MODEL_FILE) as f:
                json.dump(_model_shape(self.model_args), f, indent=1)
            _write_checksums(staging, checksums)
        if final.exists():
            logger.warning(f"Replacing the existing checkpoint {final} by the one just saved")
            stale = _incomplete(final.with_name(final.name + ".stale"))
            os.rename(final, stale)
            os.rename(staging, final)
            shutil.rmtree(stale)
        else:
            os.rename(staging, final)
        _fsync_dir(self.folder)
        self._retire_abandoned(keep=step)
        self._prune(keep=step)

    def _retire_abandoned(self, keep: int) -> None:
        """After the first checkpoint of a run that resumed from an older step, take the newer checkpoints of the
        trajectory it abandoned out of the resume's reach (never the one just published, which may have replaced
        one of them)."""
        abandoned = [step for step in self._abandoned if step != keep and self._step_path(step).is_dir()]
        self._abandoned = []
        if not abandoned:
            return
        # Every one is renamed before anything is deleted: renames are quick, so a crash is unlikely to leave some
        # of them loadable, and a `.incomplete` left half-deleted goes at the next save.
        retired = []
        for step in abandoned:
            target = _incomplete(self._step_path(step))
            if self.config.keep_latest_k == 0:
                # Keep everything, as asked, but under a name that no resume considers.
                target = self._step_path(step).with_name(f"step-{step}.abandoned")
                suffix = 1
                while target.exists():
                    suffix += 1
                    target = self._step_path(step).with_name(f"step-{step}.abandoned-{suffix}")
            os.rename(self._step_path(step), target)
            retired.append(target)
        _fsync_dir(self.folder)
        why = "it belongs to the trajectory that this run abandoned by resuming from an older step"
        for step, target in zip(abandoned, retired):
            if self.config.keep_latest_k == 0:
                logger.warning(f"Renamed checkpoint step-{step} to {target.name}: {why}")
            else:
                shutil.rmtree(target)
                logger.warning(f"Deleted checkpoint step-{step}: {why}")

    def _prune(self, keep: int) -> None:
        """Keep the `keep_latest_k` newest full checkpoints and delete older ones; delete model-only checkpoints
        older than every full one kept. Never the one just published."""
        if self.config.keep_latest_k == 0:
            return
        steps = complete_steps(self.folder)
        full = [step for step in steps if self._counts_as_full(step)]
        if not full:
            return
        kept = full[-self.config.keep_latest_k:]
        for step in steps:
            if step == keep or step in kept:
                continue
            if step in full:
                self._delete_step(step, f"keep_latest_k = {self.config.keep_latest_k} full checkpoints")
            elif step < kept[0]:
                self._delete_step(step, f"model-only, older than the {len(kept)} full checkpoint(s) kept")

    def _counts_as_full(self, step: int) -> bool:
        """Whether `step-<step>` holds the train state; one whose metadata cannot be read counts as full, so that
        keep_latest_k deletes it in turn rather than every later save failing on it."""
        try:
            return self._holds_train_state(self._step_path(step))
        except UserError:
            return True

    def _delete_step(self, step: int, why: str) -> None:
        # Renamed first, so that a crash halfway through the deletion leaves no `step-N` with missing files.
        doomed = _incomplete(self._step_path(step))
        os.rename(self._step_path(step), doomed)
        shutil.rmtree(doomed)
        logger.info(f"Deleted checkpoint step-{step} ({why})")

    def _save_hf_export(self, step: int) -> None:
        """The last checkpoint as a Hugging Face folder: every rank saves its shards of the model with DCP into a
        scratch folder, from which rank 0 assembles the full tensors (so any sharding or pipeline split works).
        The other ranks do not wait for rank 0: converting a large model could outlast the collective timeout."""
        self._wait_for_pending_save()
        final = self._step_path(step)
        scratch = _incomplete(final.with_name(final.name + ".dcp"))
        self._on_rank0(self._remove_leftovers, f"cleaning up {self.folder} before saving step {step}")
        try:
            dcp.save({"model": self.model.state_dict()}, checkpoint_id=scratch, storage_writer=_FileWriter(scratch))
        except (Exception, CheckpointException) as err:
            self._raise_save_error(err, step, scratch)
        if self.rank != 0:
            return
        try:
            save_hf(_incomplete(final), read_full_model(scratch, verify=False), self.model_args,
                    EXPORT_DTYPES[self.config.export_dtype])
            shutil.rmtree(scratch)
            self._publish(step)
        except OSError as err:
            raise UserError(f"writing the Hugging Face checkpoint {final} failed: {_describe(err)}; earlier "
                            f"checkpoints in {self.folder} are untouched") from err
        logger.info(f"Hugging Face checkpoint written to {final} ({self.config.export_dtype})")
