"""Profiler traces and memory snapshots of one step every `profiling.profile_freq` steps, per rank.

- Traces: <dump>/<save_traces_folder>/iteration_N/rank{R}_trace.json (open in Perfetto or chrome://tracing).
- Memory on GPUs: the CUDA caching allocator's history, <dump>/<save_memory_snapshot_folder>/
  rank{R}_step{N}_memory_snapshot.pickle (open at pytorch.org/memory_viz).
- Memory on the CPU: the profiler's memory accounting of the profiled step, the ops that allocated most first,
  <dump>/<save_memory_snapshot_folder>/rank{R}_step{N}_cpu_memory.txt. It shares the trace profiler (only one
  profiler can run at a time).
"""

import contextlib
import os
import pickle
import warnings
from collections.abc import Iterator

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import torch_compat
from torchtitan.tools.files import atomic_write
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
def maybe_enable_profiling(config: JobConfig, rank: int, start_step: int,
                           device: torch.device) -> Iterator[torch.profiler.profile | None]:
    """A torch profiler for traces and/or the CPU memory profile; call `.step()` once per training step."""
    profiling = config.profiling
    cpu_memory = profiling.enable_memory_snapshot and device.type != "cuda"
    if not (profiling.enable_profiling or cpu_memory):
        yield None
        return
    trace_folder = _folder(config, profiling.save_traces_folder) if profiling.enable_profiling else None
    memory_folder = _folder(config, profiling.save_memory_snapshot_folder) if cpu_memory else None

    def save(profiler: torch.profiler.profile) -> None:
        step = profiler.step_num
        if trace_folder is not None:
            step_folder = os.path.join(trace_folder, f"iteration_{step}")
            os.makedirs(step_folder, exist_ok=True)
            path = os.path.join(step_folder, f"rank{rank}_trace.json")
            # The profiler writes by path: a temporary name, renamed, so that no reader sees half a trace.
            profiler.export_chrome_trace(f"{path}.tmp")
            os.replace(f"{path}.tmp", path)
            logger.info(f"Profiler trace written to {path}")
        if memory_folder is not None:
            path = os.path.join(memory_folder, f"rank{rank}_step{step}_cpu_memory.txt")
            with atomic_write(path) as f:
                f.write(profiler.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=40))
            logger.info(f"CPU memory profile written to {path}")

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Each profiled step is written on its own; torch warns, at the second, that a cycle's events replace the last's.
    warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle", category=UserWarning)
    with torch.profiler.profile(activities=activities, schedule=_schedule(profiling.profile_freq),
                                on_trace_ready=save, record_shapes=True, profile_memory=cpu_memory) as profiler:
        profiler.step_num = start_step
        yield profiler


class _CudaMemoryRecorder:
    def __init__(self, config: JobConfig, rank: int, step: int):
        self.folder = _folder(config, config.profiling.save_memory_snapshot_folder)
        self.freq, self.rank, self.step_num = config.profiling.profile_freq, rank, step
        torch_compat.get("record_memory_history")(max_entries=100_000)

    def step(self) -> None:
        self.step_num += 1
        if self.step_num % self.freq == 0:
            path = os.path.join(self.folder, f"rank{self.rank}_step{self.step_num}_memory_snapshot.pickle")
            with atomic_write(path, "wb") as f:
                pickle.dump(torch_compat.get("memory_snapshot")(), f)
            logger.info(f"CUDA memory snapshot written to {path}")

    def close(self) -> None:
        torch_compat.get("record_memory_history")(enabled=None)


@contextlib.contextmanager
def maybe_enable_memory_snapshot(config: JobConfig, rank: int, device: torch.device,
                                 start_step: int = 0) -> Iterator[_CudaMemoryRecorder | None]:
    """CUDA allocator snapshots every profile_freq steps (on the CPU, maybe_enable_profiling records memory)."""
    if not (config.profiling.enable_memory_snapshot and device.type == "cuda"):
        yield None
        return
    recorder = _CudaMemoryRecorder(config, rank, start_step)
    try:
        yield recorder
    finally:
        recorder.close()
