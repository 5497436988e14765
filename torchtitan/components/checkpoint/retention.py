"""What becomes of a step folder once DCP has written it: published (renamed into place), then superseded,
retired or pruned (renamed out of a resume's reach), and deleted with the leftovers at the next save."""

import itertools
import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from torchtitan.components.checkpoint.integrity import fsync_dir
from torchtitan.components.checkpoint.layout import INCOMPLETE_SUFFIX, _incomplete, complete_steps
from torchtitan.components.checkpoint.model_shape import MODEL_FILE, _model_shape
from torchtitan.components.checkpoint.safe_io import METADATA_FILE
from torchtitan.errors import UserError
from torchtitan.tools.cost import Cost, Stopwatch
from torchtitan.tools.files import atomic_write
from torchtitan.tools.logging import logger

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


class Retention:
    """CheckpointManager's publishing and retention of step folders (manager.py holds the folder and the steps
    known)."""

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
