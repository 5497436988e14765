"""CheckpointManager: when to save, the folder layout (`step-N`, `.incomplete`, publishing, pruning) and resuming.
The package's `__init__` describes the layout and the keys."""

import contextlib
import itertools
import json
import os
import pickle
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint.hf import export_hf_from_dcp, load_hf_model
from torchtitan.components.checkpoint.integrity import ChecksummedFileWriter, fsync_dir, verify_checkpoint
from torchtitan.components.checkpoint.safe_io import (METADATA_FILE, FileWriter, dcp_load, describe, deserialize,
                                                      is_storage_error, read_metadata, serialize, set_element,
                                                      without_collectives)
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.distributed import torch_compat
from torchtitan.distributed.compression import EXACT
from torchtitan.distributed.utils import collectives_bounded_by, new_group_with_own_timeout
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.state_dict_adapter import is_hf_folder
from torchtitan.tools.cost import Cost, Stopwatch
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import logger

INCOMPLETE_SUFFIX = ".incomplete"
LOADABLE_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "diloco")
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
    packed.update({_PARAM_GROUPS + name: serialize(fields) for name, fields in groups.items()})
    return packed


def _unpack_param_groups(packed: dict[str, Any]) -> dict[str, Any]:
    optimizer_state: dict[str, Any] = {}
    for key, value in packed.items():
        if key.startswith(_PARAM_GROUPS):
            optimizer_state.update({f"{key}.{field}": v for field, v in deserialize(value).items()})
        else:
            optimizer_state[key] = value
    return optimizer_state


def exact_where_it_fits(template: dict[str, Any], saved: dict[str, Any], prefix: str) -> dict[str, Any]:
    """`template` without the state saved verbatim for an exact resume (`exact.` keys: a replica's or a rank's own,
    see OptimizersContainer) that the checkpoint (`saved`, its metadata; keys under `prefix`) lacks or holds in
    another shape: it loads only into the layout that saved it, elsewhere its resharded form is used."""

    def fits(key: str, value: Any) -> bool:
        entry = saved.get(prefix + key)
        return isinstance(entry, TensorStorageMetadata) and tuple(entry.size) == tuple(value.shape)

    return {key: value for key, value in template.items() if not key.startswith(EXACT) or fits(key, value)}


def require_saved_optimizer_state(checkpoint: Path, template: dict[str, Any], saved: dict[str, Any]) -> None:
    """One clear error for optimizer state the run expects and the checkpoint (`saved`, its metadata) lacks: it was
    written by another optimizer, or by a version of this one that kept other state (DCP's own error names the key
    as a corrupt or truncated checkpoint's)."""
    for key in template:
        if key.startswith(EXACT) or f"optimizer.{key}" in saved:
            continue
        hint = ""
        if key.startswith("compression."):
            hint = (" (gradient compression's state: the checkpoint was saved with another "
                    "comm.gradient_compression)")
        elif key.endswith(".delta") and f"optimizer.{key.removesuffix('delta')}momentum" in saved:
            hint = (" (it is an earlier FlexDeMo's: its momentum, in units of the gradient, became DeMo's delta, in "
                    "units of the learning-rate-scaled gradient, which cannot be derived without the learning rate "
                    "of every past step)")
        raise UserError(f"checkpoint {checkpoint} holds no optimizer.{key}: its optimizer state was saved by another "
                        f"optimizer or another version of it{hint}; resume with the optimizer that saved it, or start "
                        f"the optimizer state afresh with checkpoint.exclude_from_loading = ['optimizer']")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _incomplete(path: Path) -> Path:
    return path.with_name(path.name + INCOMPLETE_SUFFIX)


# What a superseded checkpoint is renamed to until it is deleted (`_remove_leftovers`), beside `.stale`, a step
# replaced by a newer save of the same step.
_DELETED = ".deleted"
_STALE = ".stale"


def _remove_own_files(folder: Path, rank: int) -> None:
    """Delete the data files that this rank writes into a DCP checkpoint folder, by name: DCP's file writer names
    them `__<rank>_<i>.distcp`, i = 0, 1, ... (no listing of the folder, whose entries grow with the number of
    ranks). A file that cannot be deleted is left to rank 0, which removes the folder after every rank."""
    for index in itertools.count():
        try:
            (folder / f"__{rank}_{index}.distcp").unlink()
        except OSError:
            return


def complete_steps(folder: Path) -> list[int]:
    """Steps with a complete checkpoint (`step-N` folders) in `folder`, ascending."""
    if not folder.is_dir():
        return []
    steps = [int(m.group(1)) for entry in folder.iterdir() if entry.is_dir() and (m := _STEP_FOLDER.match(entry.name))]
    return sorted(steps)


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
        dcp_load(state_dict, checkpoint, no_dist=True)
    if "optimizer" in state_dict:
        state_dict["optimizer"] = _unpack_param_groups(state_dict["optimizer"])
    if isinstance(state_dict.get("dataloader"), bytes):
        state_dict["dataloader"] = deserialize(state_dict["dataloader"])
    return state_dict


def read_full_model(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of a DCP checkpoint, unsharded, on CPU, in this process alone (no collectives)."""
    metadata = read_metadata(checkpoint)
    verify_checkpoint(checkpoint)
    prefix = "model."
    state_dict = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
                  for key, entry in metadata.state_dict_metadata.items()
                  if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    if not state_dict:
        raise UserError(f"checkpoint {checkpoint} holds no model weights (no 'model.*' entries)")
    with without_collectives():
        dcp_load(state_dict, checkpoint, no_dist=True)
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
    if config.timeout_seconds < 1:
        raise UserError(f"option checkpoint.timeout_seconds: {config.timeout_seconds} must be at least 1")
    if config.create_seed_checkpoint and not config.enable:
        raise UserError("option checkpoint.create_seed_checkpoint: it needs checkpoint.enable = true")


def _stop_checkpoint_process() -> None:
    """Stop the background process of DCP's process-based async saves, which serves every save of this process.
    torch stops it (a terminate request, then a join) only when it collects the process's handle, a module global;
    left to interpreter exit, the pipe closes first and the process prints an EOFError traceback. Dropping the handle
    runs that shutdown now; a later save starts a new process."""
    executor = sys.modules.get(torch_compat.PRIVATE_NAMES["async_checkpoint_executor"].paths[0])
    if executor is not None and getattr(executor, "_CHECKPOINT_PROCESS", None) is not None:
        executor._CHECKPOINT_PROCESS = None


@dataclass
class _PendingSave:
    completion: Future
    step: int
    staging: Path


MODEL_FILE = "model.json"


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
        raise UserError(f"checkpoint {checkpoint}: {path} cannot be read ({describe(err)})") from err
    ours = _model_shape(model_args)
    differ = [name for name in ours if name in saved and saved[name] != ours[name]
              and name not in ("ffn_dim_multiplier", "multiple_of")]
    if differ:
        raise UserError(f"checkpoint {checkpoint} was saved from another model: "
                        + ", ".join(f"{name} {saved[name]} (this run: {ours[name]})" for name in differ)
                        + "; set model.flavor and the [model] shape options it was trained with (its shape is in "
                        f"{path})")


class CheckpointManager:
    """Saves the training state every `interval` steps and resumes from the latest complete checkpoint.

    Every rank constructs one and calls `load`, `save` and `close` at the same points (they run collectives).
    Async modes need an initialised process group (the trainer always has one, possibly of size 1).
    """

    def __init__(self, config: CheckpointConfig, dump_folder: str, model_parts: list[nn.Module],
                 optimizers: Stateful, lr_schedulers: Stateful, dataloader: Stateful, train_state: TrainState,
                 model_args: TransformerModelArgs, peer_folders: Sequence[Path] = ()):
        """`peer_folders`: the checkpoint folders of the other replica groups (fault tolerance), whose weights,
        optimizer, schedule, step and data position equal this group's at every committed step: a default resume
        takes the newest full checkpoint among this group's and theirs, so that a group with an older checkpoint,
        or none, does not start behind (and, training alone while the others are down, overwrite their progress
        when they heal from it)."""
        validate_config(config)
        self.config = config
        self.folder = Path(dump_folder) / config.folder
        self.peer_folders = list(peer_folders)
        # Where the checkpoint this run resumes from lies: this group's folder, or a peer's.
        self._resume_folder = self.folder
        self.model = ModelWrapper(model_parts)
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.train_state = train_state
        self.rng = RNGState()
        # DiLoCo's state between syncs (fault_tolerance.semi_sync_method = diloco), set by the trainer once its
        # replica group exists: saved and loaded as the `diloco` part.
        self.diloco: Stateful | None = None
        self.model_args = model_args
        self.rank = _rank()
        self.rng_key = f"rng_rank{self.rank}"
        self._pending: _PendingSave | None = None
        # Steps of another trajectory, newer than the one this run resumed from: retired at its first publish.
        self._abandoned: list[int] = []
        # The step this run resumed from: if it is among the abandoned ones it is renamed aside, never deleted.
        self._resumed_from: int | None = None
        # How long each save of this run kept the training loop waiting (seconds, in order), how long until every
        # rank had written, and on rank 0 what its own work after that cost: writing DCP's `.metadata` (None where
        # the checkpoint process wrote it), then the manifest, the publishing rename and the pruning
        # (`publish_cost`, the wait for the other ranks in the collective that ends the save left out).
        self.blocked_s: list[float] = []
        self.save_s: list[float] = []
        self.metadata_cost: list[Cost | None] = []
        self.publish_cost: list[Cost] = []
        # Whether each step's checkpoint holds the train state: recorded for the checkpoints this run publishes,
        # read once from `.metadata` for the others. Pruning asks at every publish, and a `.metadata` lists every
        # rank's chunks: reading them at every publish made rank 0's publish grow with the number of ranks.
        self._full_steps: dict[int, bool] = {}
        self._own_group: dist.ProcessGroup | None = None
        self._stager: DefaultStager | None = None
        # An async save's copy of the state, still running in the background: the next optimizer step must wait
        # for it (wait_for_staging), or it would change the weights while they are being copied.
        self._staging: Future | None = None
        if config.enable and not config.load_only and config.async_mode != "disabled":
            if torch_compat.RELEASE < (2, 13):
                # Better at start-up than at the second save, hours into a run.
                raise UserError(f"option checkpoint.async_mode: {config.async_mode!r} needs torch 2.13 or newer; "
                                f"this is torch {torch.__version__} (torch 2.11's "
                                f"DCP stager fails at the second async save, pytorch/pytorch#183413). Upgrade torch, "
                                f"or set checkpoint.async_mode = 'disabled'")
            # Staging copies the state into CPU buffers that the stager keeps and refills at every save (a fresh
            # copy per save would first fault in every page of new memory); one host copy of this rank's state
            # stays allocated between saves, as a background write needs it anyway. The copy runs in a thread of
            # the stager, beside the next step's forward and backward, which write into neither the weights nor the
            # optimizer state it copies (a compressed reduce-scatter makes new tensors of the compensation state it
            # stages, which the optimizer step, after this copy, commits). With async_with_pinned_mem the buffers
            # are shared memory (pinned too on CUDA, copied without blocking) that the checkpoint process reads
            # without another copy.
            pinned_mode = config.async_mode == "async_with_pinned_mem"
            on_cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned_mode and on_cuda,
                                                        use_shared_memory=pinned_mode, use_async_staging=True,
                                                        use_non_blocking_copy=pinned_mode and on_cuda))

    def _group(self) -> dist.ProcessGroup | None:
        """The process group of every collective of a save or load: gloo, of its own, so that its waits on the
        slowest writer are bounded by checkpoint.timeout_seconds, not by the training timeout, and background saves
        never interleave with the training loop's collectives on the default (possibly NCCL) group. Created at its
        first use, which every rank reaches in the same call (load, or the first save)."""
        if self._own_group is None and dist.is_initialized():
            self._own_group = new_group_with_own_timeout(self.config.timeout_seconds)
        return self._own_group

    # ------------------------------------------------------------------------------------------------------------
    # Loading

    def load(self) -> bool:
        """Resume from the latest complete checkpoint (or `load_step`), else start from `initial_load_path`.

        Returns whether anything was loaded.
        """
        if not self.config.enable:
            return False
        with self._bounded():
            return self._load()

    def _bounded(self):
        """A failed checkpoint collective names the option that bounds it (`_group`)."""
        return collectives_bounded_by("checkpoint.timeout_seconds", self.config.timeout_seconds)

    def _load(self) -> bool:
        begin = time.perf_counter()
        wanted = [part for part in LOADABLE_PARTS if part not in self.config.exclude_from_loading
                  and (part != "diloco" or self.diloco is not None)]
        step = self._agreed_step_to_resume()
        if step is not None:
            source = self._resume_folder / f"step-{step}"
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
        if step is not None and not self.config.load_only and self._resume_folder == self.folder:
            self._abandoned = self._newer_trajectory(self.train_state.step)
            self._resumed_from = step
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

    def _agreed_step_to_resume(self) -> int | None:
        """The step every rank resumes from, or None: chosen on rank 0 and broadcast, since hosts may list the shared
        folder differently (a lagging view) and ranks that loaded different steps would train on silently. A rank
        that cannot see the chosen step makes every rank raise, naming the step and the folder."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self._step_to_resume()
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                choice = [(self._step_to_resume(), str(self._resume_folder))]
            except UserError as err:
                choice = [err]
        dist.broadcast_object_list(choice, src=0, group=self._group())
        if isinstance(choice[0], UserError):
            raise UserError(str(choice[0]))
        step, self._resume_folder = choice[0][0], Path(choice[0][1])
        if step is None:
            return None
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, step in complete_steps(self._resume_folder), group=self._group())
        blind = [rank for rank, visible in enumerate(seen) if not visible]
        if blind:
            raise UserError(f"rank 0 resumes from checkpoint step-{step} in {self._resume_folder}, which rank(s) "
                            f"{', '.join(map(str, blind))} cannot see there; every rank must see the same checkpoint "
                            f"folder (a shared file system, checkpoint.folder under job.dump_folder)")
        return step

    def _step_to_resume(self) -> int | None:
        steps = complete_steps(self.folder)
        if self.config.load_step == -1:
            # A finished run ends with a model-only save: resuming it (to train further) must start from the latest
            # checkpoint that also holds the optimizer, data position and step, not restart from step 1.
            resumable = [step for step in steps if self._is_full(step)]
            if resumable and resumable[-1] != steps[-1]:
                logger.warning(f"Resuming from step-{resumable[-1]}, the latest full checkpoint: step-{steps[-1]} "
                               f"holds only the model weights")
            own = resumable[-1] if resumable else None
            peer = self._newest_peer_checkpoint()
            if peer is not None and (own is None or peer[1] > own):
                self._resume_folder = peer[0]
                logger.warning(f"Resuming from step-{peer[1]} of another replica group ({peer[0]}), newer than this "
                               f"group's {f'step-{own}' if own is not None else 'full checkpoints (none)'}: the "
                               f"groups' states are equal at every committed step")
                return peer[1]
            return own if own is not None else (steps[-1] if steps else None)
        if self.config.load_step not in steps:
            available = ", ".join(map(str, steps)) or "none"
            raise UserError(f"option checkpoint.load_step: step {self.config.load_step} has no complete checkpoint "
                            f"in {self.folder}; available steps: {available}")
        return self.config.load_step

    def _newest_peer_checkpoint(self) -> tuple[Path, int] | None:
        """(folder, step) of the newest full checkpoint in the other replica groups' folders (the first folder
        listed wins a tie), or None."""
        best: tuple[Path, int] | None = None
        for folder in self.peer_folders:
            newest = next((step for step in reversed(complete_steps(folder))
                           if self._holds_train_state(folder / f"step-{step}")), None)
            if newest is not None and (best is None or newest > best[1]):
                best = (folder, newest)
        return best

    def _is_full(self, step: int) -> bool:
        """Whether `step-<step>` holds the train state (read from its `.metadata` once per run)."""
        if step not in self._full_steps:
            self._full_steps[step] = self._holds_train_state(self._step_path(step))
        return self._full_steps[step]

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
        verify_checkpoint(checkpoint, distributed=True, group=self._group())
        present = [part for part in wanted if self._is_saved(part, saved)]
        skipped = [part for part in wanted if part not in present and part != "rng"]
        if skipped:
            logger.warning(f"Checkpoint {checkpoint} holds no {', '.join(skipped)}; they keep their initial state")
        if "model" in present:
            check_model_shape(checkpoint, self.model_args)
            self._check_model_shapes(checkpoint, saved)
        state_dict = {self._key(part): self._load_template(part, saved) for part in present}
        if "optimizer" in present:
            require_saved_optimizer_state(checkpoint, state_dict["optimizer"], saved)
        files = list(checkpoint.glob("*.distcp"))
        logger.info(f"Loading {', '.join(present)} from {checkpoint} ({len(files)} files, "
                    f"{sum(f.stat().st_size for f in files) / 2**30:.2f} GiB)")
        dcp_load(state_dict, checkpoint, process_group=self._group())
        for part in present:
            try:
                self._apply(part, state_dict[self._key(part)])
            except pickle.UnpicklingError as err:
                raise UserError(f"checkpoint {checkpoint}: its {part} state is refused ({describe(err)})") from err
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
            return exact_where_it_fits(_pack_param_groups(self.optimizers.state_dict()), saved, "optimizer.")
        if part == "diloco":
            # A run with fault_tolerance.outer_momentum = 0 saves no momentum: a run with it then starts at zero.
            return {key: value for key, value in self.diloco.state_dict().items() if f"diloco.{key}" in saved}
        if part == "rng":
            # Only generators saved by this rank: a CPU run's checkpoint resumes on CUDA and vice versa.
            return {name: state for name, state in self.rng.state_dict().items() if f"{self.rng_key}.{name}" in saved}
        return self._stateful(part).state_dict()

    def _stateful(self, part: str) -> Stateful:
        return {"lr_scheduler": self.lr_schedulers, "train_state": self.train_state,
                "rng": self.rng, "model": self.model, "diloco": self.diloco}[part]

    def _apply(self, part: str, state: Any) -> None:
        if part == "dataloader":
            self.dataloader.load_state_dict(deserialize(state))
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
        read = load_hf_model(self.model.model_parts, folder, self.model_args)
        logger.info(f"Hugging Face import from {folder}: this rank read {read / 2**30:.2f} GiB of its weights")
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
        if force:
            # What the preemption budget needs (docs/checkpointing.md): this save must be published before the
            # scheduler's kill.
            estimate = (f"the previous save of this run took {self.save_s[-1]:.2f} s until every rank had written"
                        if self.save_s else "no earlier save of this run tells how long it takes")
            logger.warning(f"Preemption: saving a full checkpoint of step {step} now; {estimate}")
        begin = time.perf_counter()
        with self._bounded():
            if last_step and self.config.last_save_in_hf:
                self._save_hf_export(step)
            elif last_step and self.config.last_save_model_only:
                dtype = EXPORT_DTYPES[self.config.export_dtype]
                self._save_dcp(step, {"model": {name: value.to(dtype)
                                                for name, value in self.model.state_dict().items()}})
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
        """Wait for an outstanding background save and delete the checkpoints it superseded; call before exiting.
        (Rank 0 deletes them alone, without waiting for the other ranks: they may not reach `close` together, as
        after a Hugging Face export.)"""
        with self._bounded():
            self._wait_for_pending_save()
        if self.rank == 0 and self._is_saving() and self.folder.is_dir():
            try:
                self._delete_leftovers(self._leftovers())
            except OSError as err:
                logger.warning(f"Deleting the superseded checkpoints in {self.folder} failed ({describe(err)}); the "
                               f"next save removes them")
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self.config.async_mode == "async_with_pinned_mem":
            _stop_checkpoint_process()

    def _is_saving(self) -> bool:
        return self.config.enable and not self.config.load_only

    def _is_due(self, step: int, last_step: bool, force: bool) -> bool:
        if not self._is_saving():
            return False
        return (last_step or force or step % self.config.interval == 0
                or (step == 1 and self.config.enable_first_step_checkpoint))

    def _full_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": _pack_param_groups(self.optimizers.state_dict()),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "dataloader": serialize(self.dataloader.state_dict()),
            "train_state": self.train_state.state_dict(),
            self.rng_key: self.rng.state_dict(),
            **({"diloco": self.diloco.state_dict()} if self.diloco is not None else {}),
        }

    def _save_dcp(self, step: int, state_dict: dict[str, Any]) -> None:
        self._wait_for_pending_save()
        staging = _incomplete(self._step_path(step))
        full = self._is_saved("train_state", state_dict)
        self._remove_leftovers(step)
        writer = ChecksummedFileWriter(staging, collective_timeout_s=self.config.timeout_seconds)
        started = time.perf_counter()
        if self.config.async_mode == "disabled":
            try:
                dcp.save(state_dict, checkpoint_id=staging, storage_writer=writer, process_group=self._group())
            except (Exception, CheckpointException) as err:
                self._raise_save_error(err, step, staging)
            written = time.perf_counter()
            published = self._on_rank0(lambda: self._publish(step, full), f"publishing checkpoint {staging}")
            self._record_cost(step, writer, started, written, published if self.rank == 0 else None)
            return
        checkpointer = AsyncCheckpointerType.PROCESS if self.config.async_mode == "async_with_pinned_mem" else \
            AsyncCheckpointerType.THREAD
        response = dcp.async_save(state_dict, checkpoint_id=staging, storage_writer=writer,
                                  process_group=self._group(), async_checkpointer_type=checkpointer,
                                  async_stager=self._stager)
        # After close() there is no stager of ours: DCP stages synchronously and returns the upload alone.
        if isinstance(response, AsyncSaveResponse):
            self._staging, upload = response.staging_completion, response.upload_completion
        else:
            upload = response
        completed: Future = Future()

        def finish(upload: Future) -> None:
            # Runs in the background once this rank's part is written; on rank 0 that is after DCP gathered every
            # rank's results (with their files' checksums) and wrote .metadata and the manifest, so the folder is
            # complete and may be published.
            try:
                upload.result()
                written = time.perf_counter()
                published = self._publish(step, full) if self.rank == 0 else None
                self._record_cost(step, writer, started, written, published)
                completed.set_result(None)
            except BaseException as err:  # CheckpointException is a BaseException; it must reach the waiter
                completed.set_exception(err)

        upload.add_done_callback(finish)
        self._pending = _PendingSave(completed, step, staging)

    def _record_cost(self, step: int, writer: ChecksummedFileWriter, started: float, written: float,
                     published: Cost | None) -> None:
        """Log what the save cost, the figures a preemption budget needs (docs/checkpointing.md): the bytes rank 0
        wrote, the time from the start of the save until DCP's save returned (every rank had written, `save_s`),
        and on rank 0 (`published`, its publish) what only it does after that: DCP's `.metadata`, then the
        manifest, the publishing rename and the pruning (`metadata_cost`, `publish_cost`). A save's duration depends
        on the largest rank's share and the file system's bandwidth per rank; rank 0's publish does not depend on
        the number of ranks beyond one manifest entry per file. (The checkpoint process of async_with_pinned_mem
        writes `.metadata` and the manifest where this process does not time them.)"""
        self.save_s.append(written - started)
        if published is None:
            return
        if writer.manifest_cost is not None:
            published = writer.manifest_cost + published
        self.publish_cost.append(published)
        self.metadata_cost.append(writer.metadata_cost)
        # The checkpoint process of async_with_pinned_mem counts its bytes in its own copy of the writer.
        written_bytes = writer.written_bytes or sum(path.stat().st_size
                                                    for path in self._step_path(step).glob("__0_*.distcp"))
        gib = written_bytes / 2**30
        size = f"{gib:.3f} GiB" if gib >= 1 else f"{written_bytes / 2**20:.1f} MiB"
        metadata = (f", DCP's .metadata {writer.metadata_cost.wall_s:.3f} s before it"
                    if writer.metadata_cost is not None else "")
        logger.info(f"Checkpoint {self._step_path(step)}: rank 0 wrote {size} ({gib / (written - started):.2f} "
                    f"GiB/s), every rank had written after {written - started:.2f} s, publishing took "
                    f"{published.wall_s:.3f} s ({published.cpu_s:.3f} s CPU){metadata} "
                    f"(async_mode {self.config.async_mode})")

    def wait_for_staging(self) -> None:
        """Block until the last async save has copied the state; the trainer calls it before every optimizer step.
        The wait is added to that save's `blocked_s`."""
        if self._staging is None:
            return
        begin = time.perf_counter()
        staging, self._staging = self._staging, None
        # A failed copy fails the background save too, which raises it at the next save or at close().
        with contextlib.suppress(Exception):
            staging.result()
        waited = time.perf_counter() - begin
        if self.blocked_s:
            self.blocked_s[-1] += waited
        if waited >= 0.01:
            logger.info(f"The optimizer step waited {waited:.3f} s for the last checkpoint's copy of the state")

    def _wait_for_pending_save(self) -> None:
        """Wait for the background save and agree on its outcome: it can fail on one rank alone (rank 0 publishes),
        and every rank must then raise that error here, rather than the others wait for the failed rank in the next
        collective until the checkpoint timeout."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        # The background save began with the copy of the state: once it has finished, so has that.
        self._staging = None
        error = None
        try:
            pending.completion.result()
        except (Exception, CheckpointException) as err:
            error = err
        failures: list[Any] = [None if error is None else describe(error)]
        group = self._group()
        if group is not None and dist.get_world_size(group) > 1:
            failures = [None] * dist.get_world_size(group)
            dist.all_gather_object(failures, None if error is None else describe(error), group=group)
        if error is not None:
            self._raise_save_error(error, pending.step, pending.staging)
        failed = [(rank, failure) for rank, failure in enumerate(failures) if failure is not None]
        if failed:
            raise UserError(f"saving the checkpoint of step {pending.step} into {pending.staging} failed on "
                            + "; ".join(f"rank {rank}: {failure}" for rank, failure in failed)
                            + f"; earlier checkpoints in {self.folder} are untouched")

    def _raise_save_error(self, err: BaseException, step: int, staging: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if not is_storage_error(err):
            raise err
        raise UserError(f"saving the checkpoint of step {step} into {staging} failed: {describe(err)}; earlier "
                        f"checkpoints in {self.folder} are untouched") from err

    def _on_rank0(self, action: Callable[[], Any], what: str) -> Any:
        """Run a filesystem action on rank 0 alone and return its result on every rank. The broadcast of its
        outcome doubles as a barrier, and makes every rank raise if it failed, rather than leave the others waiting
        in the next collective."""
        outcome: list[Any] = [None, None]
        if self.rank == 0:
            try:
                outcome = [action(), None]
            except (OSError, UserError) as err:
                outcome = [None, f"{what} failed: {err}"]
        if dist.is_initialized():
            dist.broadcast_object_list(outcome, src=0, group=self._group())
        if outcome[1] is not None:
            raise UserError(outcome[1])
        return outcome[0]

    def _leftovers(self) -> list[str]:
        """The `*.incomplete` folders: interrupted saves and superseded checkpoints, never loaded."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return sorted(entry.name for entry in self.folder.iterdir() if entry.name.endswith(INCOMPLETE_SUFFIX))

    def _remove_leftovers(self, step: int) -> None:
        """Delete the `*.incomplete` folders before saving `step`; every rank calls it. Each rank deletes its own
        data files first, then rank 0 the rest (`.metadata`, the manifest, files of ranks beyond this run's): rank
        0's share of a superseded checkpoint does not grow with the number of ranks."""
        leftovers = self._on_rank0(self._leftovers, f"listing {self.folder} before saving step {step}")
        if not leftovers:
            return
        for name in leftovers:
            _remove_own_files(self.folder / name, self.rank)
        if dist.is_initialized():
            # Rank 0 removes the folders once every rank has removed its files: without this wait its rmtree ran
            # beside their unlinks, deleted their files itself or failed on a file another rank had just removed.
            dist.barrier(group=self._group())
        self._on_rank0(lambda: self._delete_leftovers(leftovers),
                       f"cleaning up {self.folder} before saving step {step}")

    def _delete_leftovers(self, names: list[str]) -> None:
        superseded = (_DELETED + INCOMPLETE_SUFFIX, _STALE + INCOMPLETE_SUFFIX)
        for name in names:
            why = "a superseded checkpoint" if name.endswith(superseded) else "left by an interrupted save"
            logger.info(f"Removing {self.folder / name}, {why}")
            shutil.rmtree(self.folder / name)

    def _publish(self, step: int, full: bool) -> Cost:
        """Rename `step-N.incomplete` (with its checksums, if a DCP checkpoint) to `step-N`, which holds the train
        state if `full`; returns what it cost. Touches no rank's files: its work does not grow with the ranks."""
        watch = Stopwatch()
        final = self._step_path(step)
        staging = _incomplete(final)
        if (staging / METADATA_FILE).exists():
            with atomic_write(staging / MODEL_FILE) as f:
                json.dump(_model_shape(self.model_args), f, indent=1)
        if final.exists():
            logger.warning(f"Replacing the existing checkpoint {final} by the one just saved")
            os.rename(final, _incomplete(final.with_name(final.name + _STALE)))
            os.rename(staging, final)
        else:
            os.rename(staging, final)
        self._full_steps[step] = full
        fsync_dir(self.folder)
        self._retire_abandoned(keep=step)
        self._prune(keep=step)
        return watch.cost()

    def _retire_abandoned(self, keep: int) -> None:
        """After the first checkpoint of a run that resumed from an older step, take the newer checkpoints of the
        trajectory it abandoned out of the resume's reach (never the one just published, which may have replaced
        one of them)."""
        abandoned = [step for step in self._abandoned if step != keep and self._step_path(step).is_dir()]
        self._abandoned = []
        resumed_from, self._resumed_from = self._resumed_from, None
        if not abandoned:
            return
        # Renamed, all of them at once (renames are quick, so a crash is unlikely to leave some of them loadable);
        # the ones to delete go with the leftovers at the next save.
        retired = []
        for step in abandoned:
            target = self._doomed(step)
            # Kept when asked to keep everything, and always the checkpoint this run loaded its weights from (a
            # resume without its train state restarts at step 0 from it), but under a name no resume considers.
            if self.config.keep_latest_k == 0 or step == resumed_from:
                target = self._step_path(step).with_name(f"step-{step}.abandoned")
                suffix = 1
                while target.exists():
                    suffix += 1
                    target = self._step_path(step).with_name(f"step-{step}.abandoned-{suffix}")
            os.rename(self._step_path(step), target)
            self._full_steps.pop(step, None)
            retired.append(target)
        fsync_dir(self.folder)
        why = "it belongs to the trajectory that this run abandoned by resuming from an older step"
        for step, target in zip(abandoned, retired):
            if target.name.endswith(INCOMPLETE_SUFFIX):
                logger.warning(f"Deleting checkpoint step-{step}: {why}")
            else:
                logger.warning(f"Renamed checkpoint step-{step} to {target.name}: {why}")

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
            return self._is_full(step)
        except UserError:
            return True

    def _doomed(self, step: int) -> Path:
        """What `step-<step>` is renamed to when it is to be deleted: out of the resume's reach at once, deleted
        with the leftovers at the next save (every rank its own files, `_remove_leftovers`), or at `close`."""
        return _incomplete(self._step_path(step).with_name(f"step-{step}{_DELETED}"))

    def _delete_step(self, step: int, why: str) -> None:
        os.rename(self._step_path(step), self._doomed(step))
        self._full_steps.pop(step, None)
        logger.info(f"Deleting checkpoint step-{step} ({why})")

    def _save_hf_export(self, step: int) -> None:
        """The last checkpoint as a Hugging Face folder: every rank saves its shards of the model, in the export
        dtype, with DCP into a scratch folder, from which rank 0 writes the HF folder one safetensors shard at a time
        (so any sharding or pipeline split works, and rank 0 never holds the whole model). The other ranks do not
        wait for rank 0: converting a large model could outlast the collective timeout."""
        self._wait_for_pending_save()
        final = self._step_path(step)
        scratch = _incomplete(final.with_name(final.name + ".dcp"))
        self._remove_leftovers(step)
        dtype = EXPORT_DTYPES[self.config.export_dtype]
        try:
            # In the export dtype already: no larger scratch copy on disk than the export itself.
            dcp.save({"model": {name: value.to(dtype) for name, value in self.model.state_dict().items()}},
                     checkpoint_id=scratch, storage_writer=FileWriter(scratch), process_group=self._group())
        except (Exception, CheckpointException) as err:
            self._raise_save_error(err, step, scratch)
        if self.rank != 0:
            return
        try:
            export_hf_from_dcp(scratch, _incomplete(final), self.model_args, dtype)
            shutil.rmtree(scratch)
            self._publish(step, full=False)
        except OSError as err:
            raise UserError(f"writing the Hugging Face checkpoint {final} failed: {describe(err)}; earlier "
                            f"checkpoints in {self.folder} are untouched") from err
        logger.info(f"Hugging Face checkpoint written to {final} ({self.config.export_dtype})")
