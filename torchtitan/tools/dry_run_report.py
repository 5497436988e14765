"""The dry run's report: one JSON file in the run's dump folder, written by torchtitan/dry_run.py and read by the
planner (planner/calibration.py, planner/prediction_tables.py) and by the scripts that run dry runs.

Every report says what ran: world_size, rank, flavor, layout (the degree of each mesh dimension: pp, dp_replicate,
dp_shard, cp, tp), pipeline_rank, pipeline_stages, pipeline_num_stages, pipeline_schedule, first_stage, last_stage,
local_batch_size, seq_len, activation_checkpoint, float8, parameters, flops_per_token, compile and seconds (the dry
run's own wall time).

On fake tensors (the default) it adds the rank's traced memory and communication: target_device, gpu and
gpu_memory_gib (comm.fake_gpu), peak_memory_gib, memory_gib_by_category, phase_peak_memory_gib and
memory_gib_by_phase (the peak of each phase of the step, forward, backward and optimizer step, and what it held then
by category), device_peak_memory_gib (without what CPU offload keeps on the host, offloaded_to_host),
max_peak_memory_gib and max_device_peak_memory_gib (the larger of
both ends of a pipeline; other_end_of_pipeline and pipeline_stage_memory_gib say which), compiled_estimate_gib (with
compile on), async_tp, and collectives (one step's: kind, mesh_dim, count, bytes).

On real tensors (comm.no_fake_tensors) it adds what was timed instead: device, step_seconds, median_step_seconds,
tokens_per_second_per_gpu, mfu_pct and memory (the allocator's peaks, device_info.memory_stats: max_reserved_gib and
max_allocated_gib on a GPU).
"""

import json
from pathlib import Path

REPORT_FILE = "dry_run.json"


def write_report(folder: str | Path, report: dict) -> Path:
    path = Path(folder) / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def read_report(folder: str | Path) -> dict | None:
    """The report in `folder`; None where there is none (the dry run failed before writing it). Raises ValueError
    on a file that is not JSON."""
    path = Path(folder) / REPORT_FILE
    return json.loads(path.read_text()) if path.is_file() else None
