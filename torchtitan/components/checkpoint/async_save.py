"""The async modes (`checkpoint.async_mode`): DCP's stager copies the state in the background, and the save
completes after the training loop has moved on; the next save, `close`, and the optimizer step (which must not change
what is being copied) wait for it."""

import contextlib
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from torchtitan.components.checkpoint.integrity import ChecksummedFileWriter
from torchtitan.components.checkpoint.safe_io import describe
from torchtitan.config.job_config import Checkpoint as CheckpointConfig
from torchtitan.distributed import torch_compat
from torchtitan.errors import UserError
from torchtitan.tools.logging import logger


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


def async_stager(config: CheckpointConfig) -> DefaultStager | None:
    """The stager of a run that saves with an async mode, else None."""
    if not config.enable or config.load_only or config.async_mode == "disabled":
        return None
    if torch_compat.release() < (2, 13):
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
    return DefaultStager(StagingOptions(use_pinned_memory=pinned_mode and on_cuda, use_shared_memory=pinned_mode,
                                        use_async_staging=True, use_non_blocking_copy=pinned_mode and on_cuda))


class AsyncSaving:
    """CheckpointManager's async saves (manager.py holds the stager and the pending save)."""

    def _save_dcp_async(self, step: int, state_dict: dict[str, Any], staging: Path, writer: ChecksummedFileWriter,
                        started: float, full: bool) -> None:
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

    def _stop_async_saving(self) -> None:
        """Close the stager, and stop the checkpoint process of async_with_pinned_mem."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self.config.async_mode == "async_with_pinned_mem":
            _stop_checkpoint_process()
