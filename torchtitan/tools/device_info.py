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

from torchtitan.tools.files import atomic_write
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

# The measurement must stay well under the 2 s a trainer can spend on it at start-up.
_MEASURE_BUDGET_S = 1.0
_MEASURE_REPETITIONS = 5
# Small matmuls are repeated for at least this long, so that one time slice lost to another process
# cannot spoil every repetition.
_MIN_SECONDS_PER_SIZE = 0.05
# Bigger matmuls come closer to the peak; the small ones are there for dtypes the hardware only
# emulates (CPU fp16 without native support runs at ~1 GFLOP/s, so one 1024 matmul takes 2 s).
_CPU_MATMUL_SIZES = (256, 512, 1024, 2048)
_ACCELERATOR_MATMUL_SIZES = (1024, 2048, 4096, 8192)


def peak_flops(device: torch.device, dtype: torch.dtype, configured: float = 0.0) -> tuple[float, str]:
    """Peak FLOP/s of one `device` doing matmuls in `dtype`, and a description of where it comes from.

    `configured` (metrics.peak_flops) wins when positive. Known NVIDIA GPUs get their datasheet dense
    figure (fp16 counts as bf16; fp32 counts as tf32 when TF32 matmuls are enabled). Anything else is
    measured with a square matmul, once per process; on CPU the result is also cached on disk under
    `$XDG_CACHE_HOME/torchtitan` (default `~/.cache/torchtitan`), keyed by CPU model, dtype and
    torch.get_num_threads(), so later runs skip the measurement; a figure measured while other
    processes keep the CPU busy (1-minute load average above the CPU count) is used but not cached.
    """
    if configured > 0:
        return configured, "configured (metrics.peak_flops)"
    if device.type == "cpu":
        return _cpu_peak_flops(dtype, torch.get_num_threads())
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
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


@functools.lru_cache(maxsize=None)
def _cpu_peak_flops(dtype: torch.dtype, num_threads: int) -> tuple[float, str]:
    cpu = _cpu_model_name()
    dtype_name = str(dtype).removeprefix("torch.")
    cache_file = _cache_dir() / _safe_file_name(f"cpu_peak_flops-{cpu}-{dtype_name}-{num_threads}threads.json")
    cached = _read_cached_flops(cache_file)
    if cached is not None:
        return cached, f"measured earlier on {cpu} ({dtype_name}, {num_threads} threads), cached in {cache_file}"
    busy = _cpu_is_busy()
    flops, size = _measure_matmul_flops(torch.device("cpu"), dtype)
    source = f"measured: best {size}x{size} {dtype_name} matmul on {cpu}, {num_threads} threads"
    logger.info(f"CPU peak {flops / 1e12:.3f} TFLOP/s ({source})")
    if busy:
        # Other processes competing for the cores make the figure too low; a later run measures again.
        warn_once(
            f"Other processes keep the CPU busy (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): "
            "the measured peak FLOP/s is likely too low and is not cached. Set metrics.peak_flops to override."
        )
    else:
        record = {"cpu": cpu, "dtype": dtype_name, "num_threads": num_threads, "matmul_size": size, "flops": flops}
        _write_cached_flops(cache_file, record)
    return flops, source


@functools.lru_cache(maxsize=None)
def _measured_accelerator_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    flops, size = _measure_matmul_flops(device, dtype)
    return flops, f"measured: best {size}x{size} {str(dtype).removeprefix('torch.')} matmul on {device}"


def _measure_matmul_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, int]:
    """Best FLOP/s seen over square matmuls of growing size within the time budget, and the size that got it.

    Sizes grow while the next one (8x the work) is expected to fit in what is left of the budget, so a
    dtype the hardware emulates slowly stops early instead of blowing the budget. The maximum over
    everything timed is kept: other processes sharing the device can only make a run slower.
    """
    sizes = _CPU_MATMUL_SIZES if device.type == "cpu" else _ACCELERATOR_MATMUL_SIZES
    deadline = time.perf_counter() + _MEASURE_BUDGET_S
    best_flops, best_size = 0.0, sizes[0]
    for size in sizes:
        flops, best_s = _best_matmul_flops(device, dtype, size, deadline)
        if flops > best_flops:
            best_flops, best_size = flops, size
        next_size_estimate_s = max(8 * best_s * _MEASURE_REPETITIONS, _MIN_SECONDS_PER_SIZE)
        if time.perf_counter() + next_size_estimate_s > deadline:
            break
    return best_flops, best_size


def _best_matmul_flops(device: torch.device, dtype: torch.dtype, size: int, deadline: float) -> tuple[float, float]:
    """FLOP/s and seconds of the fastest size x size matmul among _MEASURE_REPETITIONS or more.

    Repeats until both _MEASURE_REPETITIONS runs and _MIN_SECONDS_PER_SIZE have gone by, or the
    deadline has passed.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best_s = math.inf
    started = time.perf_counter()
    repetitions = 0
    while True:
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        now = time.perf_counter()
        best_s = min(best_s, now - start)
        repetitions += 1
        enough = repetitions >= _MEASURE_REPETITIONS and now - started >= _MIN_SECONDS_PER_SIZE
        if enough or now > deadline:
            return 2 * size**3 / best_s, best_s


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_is_busy() -> bool:
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchtitan"


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
