"""Which checkpoint a run resumes from: the latest full one (also among the other replica groups'), or
`load_step`, agreed on by every rank; and the newer steps of the trajectory that a resume from an older one abandons."""

from pathlib import Path
from typing import Any

import torch.distributed as dist

from torchtitan.components.checkpoint.layout import complete_steps
from torchtitan.components.checkpoint.safe_io import METADATA_FILE, read_metadata
from torchtitan.errors import UserError
from torchtitan.models.llama3.state_dict_adapter import is_hf_folder
from torchtitan.tools.logging import logger


class ResumeChoice:
    """CheckpointManager's choice of the step to resume from (manager.py holds the state it reads)."""

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
