"""The whole trainer on CPU: the debug run through run_train.sh, gradient accumulation, and every bad-input exit.

Bad inputs mostly run in this process through `torchtitan.train.main` (no interpreter start-up per case); one runs
as `python -m torchtitan.train` to prove the exit status itself.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import REPO, TINY, launch, losses, max_relative_difference, read_metrics
from torchtitan.config import parse_args
from torchtitan.train import main

pytestmark = pytest.mark.integration

STEP_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib"}


@pytest.mark.parametrize("ngpu", ["0", "-1", "abc", "2x"])
def test_run_train_sh_refuses_a_bad_process_count(ngpu):
    result = subprocess.run(["./run_train.sh"], cwd=REPO, env={**os.environ, "NGPU": ngpu}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"error: NGPU='{ngpu}' is not a positive integer: the number of training processes to " \
                            f"start on this machine\n"


@pytest.mark.parametrize("comm_mode, launched", [
    ("default", "-m torchtitan.launch --nproc_per_node=8"),
    ("fake_backend", "-m torchtitan.train --job.config_file train_configs/debug_model.toml --comm.mode fake_backend "
                     "--comm.fake_world_size 8"),
])
def test_run_train_sh_comm_mode(tmp_path, comm_mode, launched):
    """COMM_MODE=default starts NGPU processes (it used to start the one process of a dry run, which then trained
    alone); fake_backend starts the one dry-run process. A `python` of the test's own on PATH prints what would run."""
    (tmp_path / "python").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "python").chmod(0o755)
    env = {**os.environ, "NGPU": "8", "COMM_MODE": comm_mode, "CONFIG_FILE": "train_configs/debug_model.toml",
           "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(launched), result


def test_run_train_sh_refuses_an_unknown_comm_mode():
    result = subprocess.run(["./run_train.sh"], cwd=REPO, env={**os.environ, "NGPU": "8", "COMM_MODE": "fake"},
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (2, "error: COMM_MODE='fake' is not a comm.mode: default (NGPU "
                                                     "training processes) or fake_backend (a dry run of NGPU ranks "
                                                     "in one process)\n")


def test_run_train_sh_trains_the_debug_model(tmp_path):
    dump = tmp_path / "debug"
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": "train_configs/debug_model.toml", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO),
           # run_train.sh calls `torchrun` by name: find the one of the interpreter running the tests.
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = ["./run_train.sh", "--training.steps", "30", "--training.seq_len", "128", "--training.local_batch_size",
               "4", "--validation.freq", "30", "--validation.steps", "2", "--metrics.log_freq", "5",
               "--job.dump_folder", str(dump)]
    # A session of its own: on a timeout the trainer torchrun started is killed too, not only torchrun.
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, output[-6000:]

    saved = parse_args(["--job.config_file", str(dump / "config.toml")])
    assert (saved.model.flavor, saved.training.steps, saved.training.seq_len) == ("debugmodel", 30, 128)
    assert saved.job.dump_folder == str(dump)
    run_info = json.loads((dump / "run.json").read_text())
    assert (run_info["world_size"], run_info["device_type"]) == (1, "cpu") and run_info["device_name"]

    rows = read_metrics(dump)
    train_rows = [row for row in rows if "loss" in row]
    assert [row["step"] for row in train_rows] == [1, 5, 10, 15, 20, 25, 30]
    for row in train_rows:
        assert STEP_KEYS <= row.keys(), row
        assert all(math.isfinite(row[key]) for key in STEP_KEYS), row
        assert row["tps"] > 0 and row["tflops"] > 0 and row["mfu"] > 0 and row["memory_gib"] > 0, row
        assert row["grad_norm"] > 0 and row["lr"] > 0, row
    # debug_model.toml: lr 1e-3 after 5 warmup steps; the first update uses 1/6 of it.
    assert train_rows[0]["lr"] == pytest.approx(1e-3 / 6)
    # Measured on CPU (seed 0): 8.33 at step 1, 6.38-6.90 over the last three logged steps.
    loss = losses(rows)
    assert sum(loss[-3:]) / 3 < loss[0] - 1.0, loss

    validation = [row for row in rows if "validation_loss" in row]
    assert [row["step"] for row in validation] == [30]
    assert math.isfinite(validation[0]["validation_loss"]) and validation[0]["validation_loss"] < loss[0] - 1.0
    assert validation[0]["validation_perplexity"] == pytest.approx(math.exp(validation[0]["validation_loss"]),
                                                                  rel=1e-4)
    assert "validation at step 30: loss" in output

    # The log: every line of the trainer carries its rank once (torchrun's tee prefix is the only one), no colour
    # codes reach a pipe, no Python warning is printed, each logged step is one line, and no warning repeats.
    assert all(line.startswith("[rank0] ") for line in output.splitlines()), output[:3000]
    assert "[rank0]:" not in output and "[rank0] [rank0]" not in output, output[:3000]
    assert "\033[" not in output, output[:3000]
    assert "Warning:" not in output, output
    # The resolved config is in config.toml, not on the console (job.print_config is off by default).
    assert "Config:" not in output and "[model]" not in output, output[:3000]
    trainer_line = re.compile(r"^\[rank0\] \d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")
    ours = [line for line in output.splitlines() if trainer_line.search(line)]
    step_lines = [line for line in ours if " INFO step: " in line and "validation_loss" not in line]
    assert [int(line.split(" INFO step: ")[1].split()[0]) for line in step_lines] == [1, 5, 10, 15, 20, 25, 30]
    warnings = [line.split(" WARNING ", 1)[1] for line in ours if " WARNING " in line]
    assert len(warnings) == len(set(warnings)), warnings


def test_gradient_accumulation_gives_the_same_losses(tmp_path):
    base = [*TINY, "--training.steps", "4"]
    whole = launch(tmp_path / "whole", 1, [*base, "--training.local_batch_size", "4"])
    accumulated = launch(tmp_path / "accumulated", 1, [*base, "--training.local_batch_size", "2",
                                                       "--training.global_batch_size", "4"])
    assert whole.returncode == 0, whole.stdout[-6000:]
    assert accumulated.returncode == 0, accumulated.stdout[-6000:]
    assert "1 accumulation step(s)" in whole.stdout
    assert "2 accumulation step(s)" in accumulated.stdout
    whole_rows, accumulated_rows = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "accumulated")
    assert [row["step"] for row in whole_rows] == [1, 2, 3, 4]
    assert [row["tokens_seen"] for row in accumulated_rows] == [row["tokens_seen"] for row in whole_rows]
    assert max_relative_difference(losses(accumulated_rows), losses(whole_rows)) < 1e-5
    assert max_relative_difference([r["grad_norm"] for r in accumulated_rows],
                                   [r["grad_norm"] for r in whole_rows]) < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# Bad input: exit status 2, one "error:" line naming the option, no traceback


def check_one_error_line(output: str, option: str) -> str:
    assert "Traceback" not in output, output
    error_lines = [line for line in output.splitlines() if "error:" in line]
    assert len(error_lines) == 1, output
    assert option in error_lines[0], error_lines[0]
    return error_lines[0]


# (arguments, option the error must name, another fragment it must contain); {tmp} is the test's tmp_path, which
# holds an empty empty.jsonl and a malformed broken.toml.
BAD_INPUTS = {
    "tokenizer": (["--model.hf_assets_path", "/nonexistent"], "model.hf_assets_path", "/nonexistent"),
    "dataset_path": (["--training.dataset_path", "{tmp}/missing.jsonl"], "training.dataset_path", "missing.jsonl"),
    "empty_dataset": (["--training.dataset_path", "{tmp}/empty.jsonl"], "training.dataset_path", "empty"),
    "flavor": (["--model.flavor", "9B"], "model.flavor", "'9B'"),
    "global_batch": (["--training.local_batch_size", "4", "--training.global_batch_size", "6"],
                     "training.global_batch_size", "not a multiple"),
    "malformed_toml": (["--job.config_file", "{tmp}/broken.toml"], "job.config_file", "broken.toml"),
    "unknown_option": (["--training.stepz", "3"], "training.stepz", "did you mean training.steps"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_in_process(case, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.toml").write_text("[training\nsteps = 3\n")
    argv, option, fragment = BAD_INPUTS[case]
    code = main([arg.format(tmp=tmp_path) for arg in argv] + ["--job.dump_folder", str(tmp_path / "dump")])
    captured = capsys.readouterr()
    assert code == 2
    assert fragment in check_one_error_line(captured.out + captured.err, option)


def test_a_model_larger_than_host_memory_is_one_error_line(tmp_path, capsys, monkeypatch):
    """On the CPU the kernel's OOM killer would end the run during allocation, without a word."""
    from torchtitan.tools import device_info

    monkeypatch.setattr(device_info, "available_host_bytes", lambda: 2**20)
    code = main([*TINY, "--job.dump_folder", str(tmp_path / "dump")])
    captured = capsys.readouterr()
    assert code == 2
    line = check_one_error_line(captured.out + captured.err, "option model.flavor: tiny does not fit")
    assert re.search(r"need \d+\.\d GiB per process .* and 0\.0 GiB is available for 1 process", line), line


def test_bad_input_exit_status_of_the_module(tmp_path):
    proc = launch(tmp_path / "dump", 1, ["--model.hf_assets_path", "/nonexistent"], timeout=300)
    assert proc.returncode == 2, proc.stdout[-6000:]
    check_one_error_line(proc.stdout, "model.hf_assets_path")


def test_a_run_in_this_process_gives_sigterm_back(tmp_path):
    """The trainer handles SIGTERM while it trains (checkpoint, then exit 143) and restores the process's own
    handling afterwards: a program that trains in-process and goes on (a notebook, a test runner) can still be
    stopped."""
    before = signal.getsignal(signal.SIGTERM)
    assert main([*TINY, "--training.steps", "1", "--training.local_batch_size", "1",
                 "--job.dump_folder", str(tmp_path)]) == 0
    assert signal.getsignal(signal.SIGTERM) is before
