"""Profiler traces, CPU memory profiles and TensorBoard logs written by a real training run."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import TINY, launch, read_metrics

pytestmark = pytest.mark.integration


def test_profiling_memory_profile_and_tensorboard(tmp_path):
    dump = tmp_path / "run"
    proc = launch(dump, 1, [*TINY, "--training.steps", "4", "--training.local_batch_size", "2",
                            "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                            "--profiling.enable_memory_snapshot", "--metrics.enable_tensorboard"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    # Two profiled cycles, each written on its own: torch's warning that the second replaces the first's events
    # tells the user nothing.
    assert "Warning" not in proc.stdout, proc.stdout[-6000:]
    rows = read_metrics(dump)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]

    traces = sorted((dump / "profile_traces").glob("iteration_*/rank0_trace.json"))
    assert [t.parent.name for t in traces] == ["iteration_2", "iteration_4"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::mm") for e in events)

    profiles = sorted((dump / "memory_snapshot").glob("rank0_step*_cpu_memory.txt"))
    assert profiles, "no CPU memory profile written"
    assert "CPU Mem" in profiles[0].read_text()

    accumulator = EventAccumulator(str(dump / "tb"))
    accumulator.Reload()
    losses = [event.value for event in accumulator.Scalars("loss")]
    assert losses == pytest.approx([row["loss"] for row in rows], rel=1e-6)
