"""Saving: when a save is due, what it holds, writing it with DCP (the async modes: async_save.py), what it cost,
and the last save as a Hugging Face folder."""

import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from torchtitan.components.checkpoint.hf import export_hf_from_dcp
from torchtitan.components.checkpoint.integrity import ChecksummedFileWriter
from torchtitan.components.checkpoint.layout import _incomplete
from torchtitan.components.checkpoint.options import EXPORT_DTYPES
from torchtitan.components.checkpoint.safe_io import FileWriter, describe, is_storage_error, serialize
from torchtitan.components.checkpoint.state import _pack_param_groups
from torchtitan.errors import UserError
from torchtitan.tools.cost import Cost
from torchtitan.tools.logging import logger


class Saving:
    """CheckpointManager's saving (manager.py holds the state it saves)."""

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
        self._save_dcp_async(step, state_dict, staging, writer, started, full)

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

    def _raise_save_error(self, err: BaseException, step: int, staging: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if not is_storage_error(err):
            raise err
        raise UserError(f"saving the checkpoint of step {step} into {staging} failed: {describe(err)}; earlier "
                        f"checkpoints in {self.folder} are untouched") from err

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
