"""benchmarks/checkpoint_stall.py: the stall of a checkpoint save per async_mode, on the real Trainer."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import checkpoint_stall
from torchtitan.components.checkpoint import ASYNC_MODES
from torchtitan.errors import UserError

SCRIPT = Path(checkpoint_stall.__file__)


@pytest.mark.slow
def test_reports_the_stall_of_every_mode(tmp_path):
    # A process of its own, as it is meant to run: async_with_pinned_mem starts a checkpoint process that imports
    # the script as its __main__ and lives as long as its parent.
    steps = 2
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--model.flavor", "tiny", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--steps", str(steps), "--threads", "1",
         "--job.dump_folder", str(tmp_path)],
        capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    assert len(lines) == 1, completed.stdout  # stdout holds only the JSON line
    result = json.loads(lines[0])
    assert result["config"]["flavor"] == "tiny" and result["saves_per_run"] == steps
    assert result["checkpoint_mib"] > 0
    for mode in ASYNC_MODES:
        figures = result["modes"][mode]
        assert figures["stall_median_s"] > 0 and figures["step_median_s"] > 0
        assert len(figures["publish_s"]) == steps and figures["publish_median_s"] > 0
        assert len(figures["publish_cpu_s"]) == steps and 0 < figures["publish_cpu_median_s"]
        # `.metadata` is written (and timed) in this process, except by the checkpoint process of pinned_mem.
        assert (figures["metadata_median_s"] is None) == (mode == "async_with_pinned_mem")
        assert (figures["metadata_cpu_median_s"] is None) == (mode == "async_with_pinned_mem")
        assert len(figures["stall_s"]) == steps and all(stall > 0 for stall in figures["stall_s"])
        assert len(figures["train_s"]) == 1 and figures["train_s"][0] > 0
    assert result["ratio_async_to_sync"] > 0 and result["ratio_pinned_to_sync"] > 0
    assert list(tmp_path.iterdir()) == []  # the runs' folders were temporary


@pytest.mark.slow
def test_several_processes_report_rank_0s_publish_time(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--model.flavor", "tiny", "--training.seq_len", "32",
         "--training.local_batch_size", "2", "--steps", "2", "--threads", "1", "--processes", "2",
         "--job.dump_folder", str(tmp_path)],
        capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout)
    assert result["processes"] == 2 and result["config"]["world_size"] == 2
    for mode in ASYNC_MODES:
        figures = result["modes"][mode]
        assert len(figures["publish_s"]) == 2
        assert all(0 < s < figures["save_median_s"] + 1 for s in figures["publish_s"])


@pytest.mark.parametrize("argv, pattern", [
    (["--steps", "0"], r"--steps: 0 must be at least 1"),
    (["--repeats", "0"], r"--repeats: 0 must be at least 1"),
    (["--steps", "2", "--interval", "3"], r"--interval: 3 exceeds --steps 2"),
])
def test_bad_flags(argv, pattern):
    with pytest.raises(UserError, match=pattern):
        checkpoint_stall.parse_stall_args(argv)


def test_trainer_options_pass_through_with_the_debug_config_by_default():
    _, trainer_argv = checkpoint_stall.parse_stall_args(["--steps", "4", "--model.flavor", "tiny"])
    assert trainer_argv[:2] == ["--job.config_file", str(checkpoint_stall.DEFAULT_CONFIG_FILE)]
    args, trainer_argv = checkpoint_stall.parse_stall_args(["--job.config_file=x.toml", "--steps", "4"])
    assert args.steps == 4 and trainer_argv[0] == "--job.config_file=x.toml"
