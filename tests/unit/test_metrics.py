import io
import json
import logging
import math
import re
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from torchtitan.components.metrics import MetricsLogger, communication_metrics
from torchtitan.config.job_config import Metrics
from torchtitan.errors import UserError
from torchtitan.tools import device_info
from torchtitan.tools.device_info import memory_stats, peak_flops, reset_peak_memory
from torchtitan.tools.logging import CONSOLE_IS_TTY_ENV, logger

STEP_METRICS = {
    "loss": 7.1234,
    "grad_norm": 1.2345,
    "lr": 8e-4,
    "memory_gib": 1.23,
    "tps": 12345.0,
    "tflops": 12.34,
    "mfu": 12.34,
    "data_pct": 1.2,
    "tokens_seen": 1228800,
    "custom": 3.5,
}
CPU = torch.device("cpu")
ANSI_CODE = re.compile(r"\033\[[0-9;]*m")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def console():
    # The torchtitan logger may not propagate to the root logger (init_logger turns that off), so
    # caplog cannot be relied on; listen on the logger itself.
    records = _Records()
    previous_level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(records)
    logger.setLevel(previous_level)


@pytest.fixture
def private_flops_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # Whether the test machine happens to be busy must not decide whether the figure gets cached.
    monkeypatch.setattr(device_info, "_cpu_is_busy", lambda: None)
    device_info._cpu_peak_flops.cache_clear()
    yield tmp_path / "cache" / "torchtitan"
    device_info._cpu_peak_flops.cache_clear()


def _forbid_measuring(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("peak FLOP/s was measured again")

    monkeypatch.setattr(device_info, "_trial_flops", fail)


def _reject_non_standard_json(constant: str):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_jsonl_has_one_valid_json_record_per_call_with_non_finite_values_as_strings(tmp_path):
    metrics_logger = MetricsLogger(Metrics(), str(tmp_path), rank=0, is_logging_rank=True)
    before = time.time()
    metrics_logger.log(1, {"loss": 7.5, "grad_norm": float("nan"), "tps": 100})
    metrics_logger.log(2, {"loss": float("inf"), "grad_norm": -float("inf"), "lr": 1e-4})

    # Readable before close(): a crash right after log() must not lose the record.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line, parse_constant=_reject_non_standard_json) for line in lines]
    assert records[0]["step"] == 1 and records[0]["loss"] == 7.5 and records[0]["tps"] == 100
    assert records[0]["grad_norm"] == "nan"
    assert records[1] == {**records[1], "step": 2, "loss": "inf", "grad_norm": "-inf", "lr": 1e-4}
    assert before <= records[0]["time"] <= records[1]["time"] <= time.time()
    metrics_logger.close()

    reopened = MetricsLogger(Metrics(), str(tmp_path), rank=0, is_logging_rank=True)
    reopened.log(3, {"loss": 6.0})
    reopened.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_console_line_shows_every_value_without_ansi_codes_when_colour_is_off(tmp_path, console):
    metrics_logger = MetricsLogger(Metrics(disable_color_printing=True), str(tmp_path), rank=0, is_logging_rank=True)
    metrics_logger.log(10, STEP_METRICS)
    metrics_logger.close()

    assert console.messages == [
        "step:  10  loss:  7.1234  grad_norm:  1.2345  lr: 8.0e-04  memory:  1.23GiB  tps: 12,345"
        "  tflops: 12.34  mfu: 12.34%  data: 1.2%  tokens_seen: 1228800  custom: 3.5"
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _on_a_terminal(monkeypatch):
    """stderr is a terminal, and nothing in the environment says otherwise. (Set in the test itself: pytest
    installs its own capturing stderr again between a fixture's setup and the test.)"""
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv(CONSOLE_IS_TTY_ENV, raising=False)


def _console_line(tmp_path, console, config: Metrics | None = None) -> str:
    metrics_logger = MetricsLogger(config or Metrics(), str(tmp_path), rank=0, is_logging_rank=True)
    metrics_logger.log(1, {"loss": 2.0, "memory_gib": 2.5, "extra": 0.25})
    metrics_logger.close()
    (message,) = console.messages
    return message


def test_console_line_is_coloured_on_a_terminal(tmp_path, console, monkeypatch):
    _on_a_terminal(monkeypatch)
    message = _console_line(tmp_path, console)
    assert message.count("\033[0m") == 4
    assert ANSI_CODE.sub("", message) == "step:   1  loss:  2.0000  memory:  2.50GiB  extra: 0.25"


@pytest.mark.parametrize("environment", [{"NO_COLOR": "1"}, {CONSOLE_IS_TTY_ENV: "0"}, {}], ids=[
    "NO_COLOR", "launcher-console-is-a-file", "disable_color_printing"])
def test_console_line_is_plain_with_no_color_a_launcher_file_or_the_option(tmp_path, console, monkeypatch,
                                                                         environment):
    _on_a_terminal(monkeypatch)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = Metrics(disable_color_printing=not environment)
    assert _console_line(tmp_path, console, config) == "step:   1  loss:  2.0000  memory:  2.50GiB  extra: 0.25"


def test_console_line_is_plain_when_stderr_is_a_file_or_pipe(tmp_path, console, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv(CONSOLE_IS_TTY_ENV, raising=False)
    assert not ANSI_CODE.search(_console_line(tmp_path, console))
    # Through torchtitan.launch, whose own console is a terminal: coloured although stderr is a log file.
    monkeypatch.setenv(CONSOLE_IS_TTY_ENV, "1")
    console.messages.clear()
    assert ANSI_CODE.search(_console_line(tmp_path, console))


def test_tensorboard_event_file_holds_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics_logger = MetricsLogger(Metrics(enable_tensorboard=True), str(tmp_path), rank=0, is_logging_rank=True)
    metrics_logger.log(1, {"loss": 8.0, "grad_norm": 2.0, "tps": 1000.0})
    metrics_logger.log(2, {"loss": 7.0, "grad_norm": 1.5, "tps": 1100.0})
    metrics_logger.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "grad_norm", "tps"} <= set(events.Tags()["scalars"])
    assert [(event.step, event.value) for event in events.Scalars("loss")] == [(1, 8.0), (2, 7.0)]
    assert [event.value for event in events.Scalars("tps")] == [1000.0, 1100.0]


def test_non_logging_rank_writes_nothing(tmp_path, console):
    config = Metrics(enable_tensorboard=True, enable_wandb=True)
    metrics_logger = MetricsLogger(config, str(tmp_path / "dump"), rank=1, is_logging_rank=False)
    metrics_logger.log(1, STEP_METRICS)
    metrics_logger.close()

    assert not (tmp_path / "dump").exists()
    assert console.messages == []


def test_save_for_all_ranks_gives_each_rank_its_own_tensorboard_folder_and_nothing_else(tmp_path, console):
    config = Metrics(enable_tensorboard=True, save_for_all_ranks=True)
    metrics_logger = MetricsLogger(config, str(tmp_path), rank=3, is_logging_rank=False)
    metrics_logger.log(1, {"loss": 1.0})
    metrics_logger.close()

    assert list((tmp_path / "tb" / "rank_3").glob("events.out.tfevents.*"))
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not any("loss" in message for message in console.messages)


def test_wandb_offline_run_is_written_under_the_dump_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "30")
    for variable in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    dump_folder = tmp_path / "dump"

    start = time.monotonic()
    try:
        metrics_logger = MetricsLogger(
            Metrics(enable_wandb=True), str(dump_folder), rank=0, is_logging_rank=True, run_config={"lr": 8e-4}
        )
    except UserError:
        if time.monotonic() - start >= 30:
            pytest.skip("wandb took more than 30 s to start")
        raise
    metrics_logger.log(1, {"loss": 7.0, "grad_norm": float("nan")})
    metrics_logger.log(2, {"loss": 6.5})
    metrics_logger.close()

    run_folders = list((dump_folder / "wandb").glob("offline-run-*"))
    assert len(run_folders) == 1
    assert list(run_folders[0].glob("run-*.wandb"))


def test_wandb_that_cannot_start_is_a_user_error_naming_the_option(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def refuse(**kwargs):
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(UserError, match=r"metrics\.enable_wandb.*no network"):
        MetricsLogger(Metrics(enable_wandb=True), str(tmp_path), rank=0, is_logging_rank=True)


def test_wandb_missing_is_a_user_error_naming_the_option(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"metrics\.enable_wandb.*cannot be imported"):
        MetricsLogger(Metrics(enable_wandb=True), str(tmp_path), rank=0, is_logging_rank=True)


def test_memory_stats_on_cpu_report_resident_memory():
    stats = memory_stats(CPU)
    assert stats["max_rss_gib"] > 0
    assert stats["rss_gib"] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak RSS can only be reset on Linux")
def test_reset_peak_memory_on_cpu_starts_a_new_peak():
    reset_peak_memory(CPU)
    baseline = memory_stats(CPU)["max_rss_gib"]
    # Large enough for the allocator to take it straight from (and give it back to) the OS.
    spike = torch.ones(32 * 1024**2)
    del spike
    peak = memory_stats(CPU)["max_rss_gib"]
    assert peak >= baseline + 0.1

    reset_peak_memory(CPU)
    assert memory_stats(CPU)["max_rss_gib"] < peak - 0.1


def _trials(monkeypatch, rates: list[float]) -> None:
    """The trials of the next measurement give these FLOP/s (a shared test machine gives anything)."""
    remaining = iter(rates)
    monkeypatch.setattr(device_info, "_trial_flops", lambda device, dtype, size, seconds: next(remaining))
    monkeypatch.setattr(device_info, "_matmul_seconds", lambda device, dtype, size: 1e-4)


STABLE_TRIALS = [97e9, 100e9, 95e9, 99e9, 98e9]


def test_cpu_peak_is_measured_with_real_matmuls_for_at_least_a_second(private_flops_cache):
    start = time.monotonic()
    flops, source = peak_flops(CPU, torch.float32)
    # Five trials over at least a second, plus the ramp that picks the matmul size (the machine may be shared).
    assert 1.0 <= time.monotonic() - start < 6
    assert flops > 0 and math.isfinite(flops)
    assert re.match(r"measured: best of 5 trials of \d+x\d+ float32 matmuls over 1 s, spread \d+% on .*, 1 threads",
                    source), source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_peak_flops_is_measured_once_then_cached_in_process_and_on_disk(dtype, private_flops_cache, monkeypatch):
    _trials(monkeypatch, STABLE_TRIALS)
    flops, source = peak_flops(CPU, dtype)
    assert flops == 100e9 and source.startswith("measured")
    cache_files = list(private_flops_cache.glob("cpu_peak_flops-*.json"))
    assert len(cache_files) == 1
    assert str(dtype).removeprefix("torch.") in cache_files[0].name

    _forbid_measuring(monkeypatch)
    assert peak_flops(CPU, dtype) == (flops, source)

    device_info._cpu_peak_flops.cache_clear()
    cached_flops, cached_source = peak_flops(CPU, dtype)
    assert cached_flops == flops
    assert str(cache_files[0]) in cached_source


def test_unreadable_flops_cache_is_measured_again(private_flops_cache, monkeypatch):
    _trials(monkeypatch, STABLE_TRIALS * 2)
    private_flops_cache.mkdir(parents=True)
    peak_flops(CPU, torch.float32)
    (cache_file,) = private_flops_cache.glob("*.json")
    cache_file.write_text("{not json")
    device_info._cpu_peak_flops.cache_clear()

    flops, source = peak_flops(CPU, torch.float32)
    assert flops > 0 and source.startswith("measured")
    assert json.loads(cache_file.read_text())["flops"] == flops


def test_measurement_on_a_busy_cpu_is_not_cached(private_flops_cache, monkeypatch):
    _trials(monkeypatch, STABLE_TRIALS)
    monkeypatch.setattr(device_info, "_cpu_is_busy", lambda: "load average 9.0 on 2 CPUs")
    flops, source = peak_flops(CPU, torch.float32)
    assert flops > 0 and source.startswith("measured") and source.endswith("CPU busy: not cached")
    assert not list(private_flops_cache.glob("*.json"))


@pytest.mark.parametrize(("load", "others", "threads", "busy"), [
    (0.5, 0, 2, None), (3.0, 0, 1, "load average 3.0 on 2 CPUs"),
    (0.5, 1, 2, "1 other runnable threads beside 2 of ours on 2 CPUs"), (0.5, 1, 1, None),
    (0.5, 2, 1, "2 other runnable threads beside 1 of ours on 2 CPUs"), (0.5, None, 2, None)])
def test_cpu_is_busy_over_the_last_minute_or_right_now(monkeypatch, load, others, threads, busy):
    monkeypatch.setattr(device_info.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(device_info.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(device_info, "_other_runnable_threads", lambda: others)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert device_info._cpu_is_busy() == busy


def test_stable_measurement_is_the_best_trial_and_cached(private_flops_cache, monkeypatch, console):
    _trials(monkeypatch, STABLE_TRIALS)
    flops, source = peak_flops(CPU, torch.float32)
    assert flops == 100e9
    assert "best of 5 trials of 2048x2048 float32 matmuls over 1 s, spread 5%" in source
    (cache_file,) = private_flops_cache.glob("*.json")
    assert json.loads(cache_file.read_text())["flops"] == 100e9
    assert not [m for m in console.messages if "unstable" in m]


def test_unstable_measurement_is_used_for_the_run_but_not_cached(private_flops_cache, monkeypatch, console):
    # The case: a neighbour takes half the CPU during some of the trials.
    _trials(monkeypatch, [140e9, 70e9, 72e9, 139e9, 71e9])
    flops, source = peak_flops(CPU, torch.float32)
    assert flops == 140e9
    assert "spread 50%" in source and source.endswith("unstable: not cached")
    assert not list(private_flops_cache.glob("*.json"))
    assert [m for m in console.messages if "unstable (its trials differed by 50%" in m and "metrics.peak_flops" in m]


def test_configured_peak_flops_wins(private_flops_cache, monkeypatch):
    _forbid_measuring(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    for device in (CPU, torch.device("cuda")):
        flops, source = peak_flops(device, torch.bfloat16, configured=123e12)
        assert flops == 123e12
        assert "configured" in source


@pytest.mark.parametrize(
    ("device_name", "model", "bf16_flops"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
        ("NVIDIA A100 80GB PCIe", "A100", 312e12),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12),
        ("NVIDIA H200", "H200 SXM", 989e12),
        ("NVIDIA B200", "B200", 2.25e15),
    ],
)
def test_known_gpus_get_their_datasheet_figure(device_name, model, bf16_flops, monkeypatch):
    _forbid_measuring(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    gpu = torch.device("cuda")

    flops, source = peak_flops(gpu, torch.bfloat16)
    assert flops == bf16_flops
    assert device_name in source and model in source
    assert peak_flops(gpu, torch.float16)[0] == bf16_flops

    # Stand-ins for torch.backends.cuda.matmul, so that the process's real TF32 setting is left alone.
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(fp32_precision="none"))
    fp32_flops, fp32_source = peak_flops(gpu, torch.float32)
    monkeypatch.setattr(torch.backends.cuda, "matmul", SimpleNamespace(fp32_precision="tf32"))
    tf32_flops, tf32_source = peak_flops(gpu, torch.float32)
    assert fp32_flops < tf32_flops < bf16_flops
    assert "fp32" in fp32_source and "tf32" in tf32_source


def test_communication_metrics_keep_each_kind_of_bytes_apart():
    """Per step since the last log: the compressed collectives against full precision (the percentage over the run),
    an optimizer's own exchange (Muon's) and its part across replicas, which must not enter that percentage, and what
    saves sent, only when a save ran since the last log."""
    mib = 2**20
    before = {"sent_bytes": 10 * mib, "uncompressed_bytes": 40 * mib, "exchange_sent_bytes": 4 * mib,
              "exchange_replica_bytes": 0, "save_sent_bytes": 3 * mib}
    now = {"sent_bytes": 20 * mib, "uncompressed_bytes": 80 * mib, "exchange_sent_bytes": 12 * mib,
           "exchange_replica_bytes": 2 * mib, "save_sent_bytes": 7 * mib}
    assert communication_metrics(now, before, steps=2) == {
        "comm_sent_mib_per_step": 5.0, "comm_full_precision_mib_per_step": 20.0, "comm_sent_pct": 25.0,
        "optimizer_exchange_mib_per_step": 4.0, "optimizer_exchange_across_replicas_mib_per_step": 1.0,
        "checkpoint_state_sent_mib": 4.0}
    quiet = dict.fromkeys(now, 0)
    assert communication_metrics(quiet, {}, steps=1) == {}
    assert "checkpoint_state_sent_mib" not in communication_metrics(now, now, steps=1)
