"""scripts/benchmark.py: the JSON line it prints, and its transformers comparison training the same model."""

import json
import math

import pytest

from scripts import benchmark

TINY = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32", "--metrics.peak_flops", "1e12", "--threads", "1"]


def run_benchmark(capsys, *argv: str) -> dict:
    assert benchmark.main([*TINY, *argv]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, "stdout holds the JSON line alone"
    return json.loads(lines[0])


def test_json_line_reports_throughput_mfu_and_memory(capsys):
    result = run_benchmark(capsys, "--warmup", "1", "--steps", "2")
    assert result["config"]["flavor"] == "tiny" and result["config"]["world_size"] == 1
    assert result["steps"] == 2 and result["step_time_s"] > 0
    tokens_per_step = 2 * 32
    assert math.isclose(result["tokens_per_s_per_device"], tokens_per_step / result["step_time_s"])
    # MFU against the configured 1 TFLOP/s peak.
    assert result["peak"]["tflops"] == 1.0
    assert result["mfu_pct"] > 0
    # (The increase over the baseline RSS is not checked: in this process the baseline holds earlier tests' memory.)
    assert result["peak_memory_gib"] > 0 and "peak_memory_over_baseline_gib" in result
    assert math.isfinite(result["first_loss"]) and math.isfinite(result["last_loss"])
    assert "hf" not in result


def test_transformers_comparison_trains_the_same_model(capsys):
    """Same initial weights and first batch in fp32: transformers' first loss equals ours, so the ratio compares the
    same computation."""
    result = run_benchmark(capsys, "--warmup", "1", "--steps", "2", "--hf")
    hf = result["hf"]
    assert hf["first_loss"] == pytest.approx(result["first_loss"], rel=1e-5)
    assert hf["tokens_per_s_per_device"] > 0 and hf["ratio"] > 0 and hf["ratio_cpu_time"] > 0
    assert math.isclose(hf["ratio"], hf["step_time_s"] / hf["ours_step_time_s_alternating"])


def test_bad_arguments_are_one_error(capsys):
    assert benchmark.main([*TINY, "--steps", "0"]) == 2
    assert "--warmup and --steps must be at least 1" in capsys.readouterr().err
