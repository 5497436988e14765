"""CheckpointManager: the run's state to save, the process group of its collectives, and `close`. Its parts, one
file each: which step to resume from (resume.py), loading (loading.py), saving (saving.py), the async modes
(async_save.py), publishing and retention of the step folders (retention.py). The package's `__init__` describes the
layout and the keys."""

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.components.checkpoint.async_save import AsyncSaving, _PendingSave, async_stager
from torchtitan.components.checkpoint.loading import Loading
from torchtitan.components.checkpoint.options import validate_config
from torchtitan.components.checkpoint.resume import ResumeChoice
from torchtitan.components.checkpoint.retention import Retention
from torchtitan.components.checkpoint.safe_io import describe
from torchtitan.components.checkpoint.saving import Saving
from torchtitan.components.checkpoint.state import ModelWrapper, RNGState, TrainState
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.distributed.utils import collectives_bounded_by, new_group_with_own_timeout
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.tools.cost import Cost
from torchtitan.tools.logging import logger


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class CheckpointManager(ResumeChoice, Loading, Saving, AsyncSaving, Retention):
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
        # An async save's copy of the state, still running in the background: the next optimizer step must wait
        # for it (wait_for_staging), or it would change the weights while they are being copied.
        self._staging: Future | None = None
        self._stager: DefaultStager | None = async_stager(config)

    def _group(self) -> dist.ProcessGroup | None:
        """The process group of every collective of a save or load: gloo, of its own, so that its waits on the
        slowest writer are bounded by checkpoint.timeout_seconds, not by the training timeout, and background saves
        never interleave with the training loop's collectives on the default (possibly NCCL) group. Created at its
        first use, which every rank reaches in the same call (load, or the first save)."""
        if self._own_group is None and dist.is_initialized():
            self._own_group = new_group_with_own_timeout(self.config.timeout_seconds)
        return self._own_group

    def _bounded(self):
        """A failed checkpoint collective names the option that bounds it (`_group`)."""
        return collectives_bounded_by("checkpoint.timeout_seconds", self.config.timeout_seconds)

    def _step_path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def _key(self, part: str) -> str:
        return self.rng_key if part == "rng" else part

    def _is_saved(self, part: str, saved: dict[str, Any]) -> bool:
        key = self._key(part)
        return key in saved or any(name.startswith(key + ".") for name in saved)

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
        self._stop_async_saving()

    def _is_saving(self) -> bool:
        return self.config.enable and not self.config.load_only
