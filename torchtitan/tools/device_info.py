"""What one device can do and what it is using: peak FLOP/s (for MFU) and memory statistics."""

import functools
import json
import math
import os
import platform
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchtitan.errors import UserError
from torchtitan.tools.files import atomic_write, cache_dir
from torchtitan.tools.logging import logger, warn_once

_GIB = 1024**3


@dataclass(frozen=True)
class _Datasheet:
    """Dense (no sparsity) tensor-core FLOP/s of one GPU, per the vendor's datasheet."""

    model: str
    bf16: float
    tf32: float
    fp32: float


# Checked in order against torch.cuda.get_device_name, so a variant ("H100 NVL") precedes the family
# name it contains ("H100"), and "GH200" precedes "H200".
_DATASHEETS = (
    ("B200", _Datasheet("B200", bf16=2.25e15, tf32=1.125e15, fp32=75e12)),
    ("GH200", _Datasheet("GH200", bf16=989e12, tf32=494.5e12, fp32=67e12)),
    ("H200 NVL", _Datasheet("H200 NVL", bf16=835e12, tf32=417.5e12, fp32=60e12)),
    ("H200", _Datasheet("H200 SXM", bf16=989e12, tf32=494.5e12, fp32=67e12)),
    ("H100 NVL", _Datasheet("H100 NVL", bf16=835e12, tf32=417.5e12, fp32=60e12)),
    ("H100 PCIe", _Datasheet("H100 PCIe", bf16=756e12, tf32=378e12, fp32=51e12)),
    # The SXM part reports itself by memory ("NVIDIA H100 80GB HBM3"), not by form factor.
    ("H100", _Datasheet("H100 SXM", bf16=989e12, tf32=494.5e12, fp32=67e12)),
    ("A100", _Datasheet("A100", bf16=312e12, tf32=156e12, fp32=19.5e12)),
)

# The measurement: _TRIALS timed trials of back-to-back matmuls, _MEASURE_SECONDS in all, after a short ramp that
# picks the matmul size; a trial's figure is its fastest matmul. The best trial is the peak; when the trials differ
# by more than _MAX_SPREAD of it, the device was shared during the measurement and the figure is not trusted (used
# for this run, never cached).
_MEASURE_SECONDS = 1.0
_TRIALS = 5
_MAX_SPREAD = 0.10
# The ramp stops at the size whose matmul would take more than this share of one trial. Bigger matmuls come closer
# to the peak; the small ones are there for dtypes the hardware only emulates (CPU fp16 without native support runs
# at ~1 GFLOP/s, so one 1024 matmul takes 2 s).
_MAX_MATMUL_SHARE_OF_TRIAL = 0.25
_CPU_MATMUL_SIZES = (256, 512, 1024, 2048)
_ACCELERATOR_MATMUL_SIZES = (1024, 2048, 4096, 8192)


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float = 0.0) -> tuple[float, str]:
    """Peak FLOP/s of one `device` doing matmuls in `dtype`, and a description of where it comes from.

    `configured` (metrics.peak_flops) wins when positive. Known NVIDIA GPUs get their datasheet dense
    figure (fp16 counts as bf16; fp32 counts as tf32 when TF32 matmuls are enabled). Anything else is
    measured, once per process: the best of 5 timed trials of square matmuls over 1 s. On CPU a stable
    result is also cached on disk under `$XDG_CACHE_HOME/torchtitan` (default `~/.cache/torchtitan`),
    keyed by CPU model, dtype and torch.get_num_threads(), so later runs skip the measurement. A figure
    whose trials differ by more than 10% (the CPU was shared part of the time), or measured while other
    processes keep the CPU busy (1-minute load average above the CPU count, or more other runnable
    threads than the cores our threads leave), is used for this run with a warning but not cached.
    """
    if configured > 0:
        return configured, "configured (metrics.peak_flops)"
    if device.type == "cpu":
        return _cpu_peak_flops(dtype, torch.get_num_threads())
    if device.type == "cuda":
        name = device_name(device)
        datasheet = _datasheet(name)
        if datasheet is not None and dtype in (torch.bfloat16, torch.float16, torch.float32):
            figure, precision = _datasheet_figure(datasheet, dtype)
            return figure, f"datasheet: {name} ({datasheet.model}, dense {precision})"
        warn_once(
            f"No datasheet peak FLOP/s for {name} in {dtype}; measuring a matmul instead. "
            "Set metrics.peak_flops to use the vendor's figure."
        )
    return _measured_accelerator_peak_flops(device, dtype)


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset_peak_memory (or process start), plus allocator trouble counts.

    CUDA: max_allocated_gib, max_reserved_gib, max_allocated_pct (of the device's total memory),
    num_alloc_retries, num_ooms. CPU: max_rss_gib (peak resident set size) and rss_gib (current).
    Other devices: empty.
    """
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        total_bytes = torch.cuda.get_device_properties(device).total_memory
        max_allocated_bytes = stats.get("allocated_bytes.all.peak", 0)
        return {
            "max_allocated_gib": max_allocated_bytes / _GIB,
            "max_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / _GIB,
            "max_allocated_pct": 100.0 * max_allocated_bytes / total_bytes,
            "num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "num_ooms": float(stats.get("num_ooms", 0)),
        }
    if device.type == "cpu":
        stats = {"max_rss_gib": _max_rss_bytes() / _GIB}
        current_rss_bytes = _current_rss_bytes()
        if current_rss_bytes is not None:
            stats["rss_gib"] = current_rss_bytes / _GIB
        return stats
    warn_once(f"Memory statistics are not collected on {device.type} devices.")
    return {}


def available_host_bytes() -> int | None:
    """Memory the kernel can give new allocations without swapping (Linux's MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def require_host_memory(needed: int, model: str, processes_on_node: int) -> None:
    """Before a model that lives in host memory (a CPU run, or FSDP's CPU offload) is allocated: `needed`, the bytes
    of this process's parameters and their gradients, must fit its share of the available memory. Otherwise the
    kernel's OOM killer ends the run during allocation, without a word. Optimizer state and activations come on top:
    passing promises no fit, failing is certain."""
    available = available_host_bytes()
    if available is None:
        return
    if needed > available / processes_on_node:
        raise UserError(
            f"option model.flavor: {model} does not fit this machine's memory: its parameters and their gradients "
            f"alone need {needed / _GIB:.1f} GiB per process (this process's shard), and {available / _GIB:.1f} GiB "
            f"is available for {processes_on_node} process(es) on this node. Train a smaller model (model.flavor, "
            f"the [model] shape options), shard it over more processes or hosts, or train on GPUs; a dry run "
            f"(COMM_MODE=fake_backend) reports a layout's whole memory without allocating it")


def memory_capacity(device: torch.device, processes_on_node: int) -> tuple[int | None, str]:
    """Bytes one process may hold on `device`, and what they are: a GPU's total memory, or this process's share of
    the host's available memory on the CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device_name(device)} memory"
    if device.type == "cpu":
        available = available_host_bytes()
        return (None if available is None else available // processes_on_node,
                f"host memory available to each of {processes_on_node} process(es)")
    return None, ""


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window for memory_stats."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu":
        # Linux resets the process's RSS high-water mark, which getrusage reports, on this write.
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError as exc:
            warn_once(f"Cannot reset the peak RSS ({exc}); max_rss_gib counts from process start.")


def device_name(device: torch.device) -> str:
    """The accelerator's name (e.g. "NVIDIA H100 80GB HBM3"), or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model_name()


def _datasheet(device_name: str) -> _Datasheet | None:
    for name_part, datasheet in _DATASHEETS:
        if name_part in device_name:
            return datasheet
    return None


def _datasheet_figure(datasheet: _Datasheet, dtype: torch.dtype) -> tuple[float, str]:
    if dtype != torch.float32:
        return datasheet.bf16, "bf16"
    # With the default precision fp32 matmuls stay in IEEE fp32; "tf32" routes them through tensor cores.
    if torch.backends.cuda.matmul.fp32_precision == "tf32":
        return datasheet.tf32, "tf32"
    return datasheet.fp32, "fp32"


@dataclass(frozen=True)
class _Measurement:
    flops: float
    """The best trial's FLOP/s."""
    size: int
    spread: float
    """(best - worst) / best over the trials."""
    description: str

    @property
    def stable(self) -> bool:
        return self.spread <= _MAX_SPREAD


@functools.lru_cache(maxsize=None)
def _cpu_peak_flops(dtype: torch.dtype, num_threads: int) -> tuple[float, str]:
    cpu = _cpu_model_name()
    dtype_name = str(dtype).removeprefix("torch.")
    cache_file = cache_dir() / _safe_file_name(f"cpu_peak_flops-{cpu}-{dtype_name}-{num_threads}threads.json")
    cached = _read_cached_flops(cache_file)
    if cached is not None:
        return cached, f"measured earlier on {cpu} ({dtype_name}, {num_threads} threads), cached in {cache_file}"
    busy = _cpu_is_busy()
    measurement = _measure_matmul_flops(torch.device("cpu"), dtype)
    busy = busy or _cpu_is_busy()
    source = f"measured: {measurement.description} on {cpu}, {num_threads} threads"
    logger.info(f"CPU peak {measurement.flops / 1e12:.3f} TFLOP/s ({source})")
    if not measurement.stable:
        source += ", unstable: not cached"
        warn_once(
            f"The peak FLOP/s measurement was unstable (its trials differed by {measurement.spread:.0%}, more than "
            f"{_MAX_SPREAD:.0%}): other work shared the CPU, so this run's MFU uses the best trial and may be too "
            "high, and the figure is not cached. Set metrics.peak_flops to fix it."
        )
    elif busy:
        # Other processes competing for the cores all along make every trial equally too slow.
        source += ", CPU busy: not cached"
        warn_once(
            f"Other processes keep the CPU busy ({busy}): the measured peak FLOP/s is likely too low and is not "
            "cached. Set metrics.peak_flops to override."
        )
    else:
        record = {"cpu": cpu, "dtype": dtype_name, "num_threads": num_threads, "matmul_size": measurement.size,
                  "flops": measurement.flops, "spread": measurement.spread}
        _write_cached_flops(cache_file, record)
    return measurement.flops, source


@functools.lru_cache(maxsize=None)
def _measured_accelerator_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    measurement = _measure_matmul_flops(device, dtype)
    if not measurement.stable:
        warn_once(f"The peak FLOP/s measurement on {device} was unstable (its trials differed by "
                  f"{measurement.spread:.0%}); set metrics.peak_flops to fix the figure MFU uses.")
    return measurement.flops, f"measured: {measurement.description} on {device}"


def _measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> _Measurement:
    """The best of _TRIALS timed trials of back-to-back square matmuls (_MEASURE_SECONDS in all), at the largest
    size of the ramp whose single matmul fits in a quarter of a trial. Other work sharing the device can only make
    a matmul slower, so the best is the peak, and the spread of the trials shows whether there was any."""
    sizes = _CPU_MATMUL_SIZES if device.type == "cpu" else _ACCELERATOR_MATMUL_SIZES
    trial_seconds = _MEASURE_SECONDS / _TRIALS
    size = sizes[0]
    for candidate in sizes:
        if _matmul_seconds(device, dtype, candidate) > _MAX_MATMUL_SHARE_OF_TRIAL * trial_seconds:
            break
        size = candidate
    rates = [_trial_flops(device, dtype, size, trial_seconds) for _ in range(_TRIALS)]
    best = max(rates)
    spread = (best - min(rates)) / best
    dtype_name = str(dtype).removeprefix("torch.")
    return _Measurement(best, size, spread, f"best of {_TRIALS} trials of {size}x{size} {dtype_name} matmuls over "
                                            f"{_MEASURE_SECONDS:g} s, spread {spread:.0%}")


def _matmul_seconds(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """Seconds of one size x size matmul, timed after one untimed (warm-up) run."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    start = time.perf_counter()
    torch.matmul(a, b)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return time.perf_counter() - start


def _trial_flops(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float:
    """FLOP/s of the fastest of the size x size matmuls run back to back for at least `seconds` (and at least
    twice): a time slice lost to another process slows some matmuls of the trial, not the fastest."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    count = 0
    fastest = math.inf
    started = time.perf_counter()
    while True:
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        now = time.perf_counter()
        fastest = min(fastest, now - start)
        count += 1
        if count >= 2 and now - started >= seconds:
            return 2 * size**3 / fastest


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_is_busy() -> str | None:
    """Why other processes compete for the cores, if they do: over the last minute (load average above the CPU
    count), or right now (more other runnable threads, /proc/loadavg's less this process's, than the CPUs this
    process's torch threads leave free; other ranks measuring beside it with a core each do not count)."""
    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0]
    if load > cpus:
        return f"load average {load:.1f} on {cpus} CPUs"
    others = _other_runnable_threads()
    if others is not None and others > cpus - torch.get_num_threads():
        return f"{others} other runnable threads beside {torch.get_num_threads()} of ours on {cpus} CPUs"
    return None


def _other_runnable_threads() -> int | None:
    """Threads of other processes running or waiting for a core right now (Linux), or None where unknown."""
    try:
        with open("/proc/loadavg") as loadavg:
            runnable = int(loadavg.read().split()[3].split("/")[0])
        own = sum(1 for stat in Path("/proc/self/task").glob("*/stat") if _thread_state(stat) == "R")
    except (OSError, ValueError, IndexError):
        return None
    return max(runnable - own, 0)


def _thread_state(stat_file: Path) -> str:
    try:
        return stat_file.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""  # the thread has exited


def _safe_file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def _read_cached_flops(cache_file: Path) -> float | None:
    try:
        flops = float(json.loads(cache_file.read_text())["flops"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warn_once(f"Ignoring unreadable peak FLOP/s cache {cache_file} ({exc}); measuring again.")
        return None
    return flops if math.isfinite(flops) and flops > 0 else None


def _write_cached_flops(cache_file: Path, record: dict) -> None:
    # Atomic: ranks measuring at the same time, or a crash mid-write, never leave a half-written file for the next
    # run to read.
    try:
        with atomic_write(cache_file) as f:
            json.dump(record, f)
    except OSError as exc:
        warn_once(f"Cannot cache the measured peak FLOP/s in {cache_file} ({exc}); it will be measured again.")


def _max_rss_bytes() -> int:
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return max_rss if sys.platform == "darwin" else max_rss * 1024


def _current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
