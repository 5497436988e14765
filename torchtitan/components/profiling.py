"""Profiler traces and memory snapshots of one step every `profiling.profile_freq` steps, per rank."""

import contextlib
import os
import pickle
from collections.abc import Iterator

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

_WARMUP_STEPS = 3
_ACTIVE_STEPS = 1


def _folder(config: JobConfig, name: str) -> str:
    folder = os.path.join(config.job.dump_folder, name)
    os.makedirs(folder, exist_ok=True)
    return folder


def _schedule(profile_freq: int) -> torch.profiler.schedule:
    warmup = min(_WARMUP_STEPS, max(profile_freq - _ACTIVE_STEPS, 0))
    return torch.profiler.schedule(wait=profile_freq - warmup - _ACTIVE_STEPS, warmup=warmup,
                                   active=_ACTIVE_STEPS)


@contextlib.contextmanager
def maybe_enable_profiling(config: JobConfig, rank: int, start_step: int) -> Iterator[torch.profiler.profile | None]:
    """Chrome traces in <dump>/<save_traces_folder>/iteration_N/rank{R}_trace.json; call `.step()` per step."""
    if not config.profiling.enable_profiling:
        yield None
        return
    folder = _folder(config, config.profiling.save_traces_folder)

    def save_trace(profiler: torch.profiler.profile) -> None:
        step_folder = os.path.join(folder, f"iteration_{profiler.step_num}")
        os.makedirs(step_folder, exist_ok=True)
        path = os.path.join(step_folder, f"rank{rank}_trace.json")
        profiler.export_chrome_trace(path)
        logger.info(f"Profiler trace written to {path}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, schedule=_schedule(config.profiling.profile_freq),
                                on_trace_ready=save_trace, record_shapes=True) as profiler:
        profiler.step_num = start_step
        yield profiler


class _MemoryRecorder:
    """Every profile_freq steps: the CUDA allocator's history as a pickle (open it at pytorch.org/memory_viz),
    or on the CPU a table of the ops that allocated most memory during the last profiled step."""

    def __init__(self, config: JobConfig, rank: int, device: torch.device, step: int):
        self.folder = _folder(config, config.profiling.save_memory_snapshot_folder)
        self.freq, self.rank, self.device, self.step_num = config.profiling.profile_freq, rank, device, step
        self.cpu_profiler: torch.profiler.profile | None = None
        if device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        else:
            self.cpu_profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                       profile_memory=True,
                                                       schedule=_schedule(self.freq),
                                                       on_trace_ready=self._save_cpu_profile)
            self.cpu_profiler.start()

    def step(self) -> None:
        self.step_num += 1
        if self.cpu_profiler is not None:
            self.cpu_profiler.step()
        elif self.step_num % self.freq == 0:
            path = os.path.join(self.folder, f"rank{self.rank}_step{self.step_num}_memory_snapshot.pickle")
            with open(path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            logger.info(f"CUDA memory snapshot written to {path}")

    def _save_cpu_profile(self, profiler: torch.profiler.profile) -> None:
        path = os.path.join(self.folder, f"rank{self.rank}_step{self.step_num + 1}_cpu_memory.txt")
        with open(path, "w") as f:
            f.write(profiler.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=40))
        logger.info(f"CPU memory profile written to {path}")

    def close(self) -> None:
        if self.cpu_profiler is not None:
            self.cpu_profiler.stop()
        else:
            torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def maybe_enable_memory_snapshot(config: JobConfig, rank: int, device: torch.device,
                                 start_step: int = 0) -> Iterator[_MemoryRecorder | None]:
    if not config.profiling.enable_memory_snapshot:
        yield None
        return
    recorder = _MemoryRecorder(config, rank, device, start_step)
    try:
        yield recorder
    finally:
        recorder.close()
