"""scripts/plan.py --calibrate: the performance model against a user's own GPU runs, its constants refitted.

The runs are the six measured on one H100 (docs/scaling.md, "Checked on one H100"), written as the trainer writes a
dump folder: the resolved config.toml, run.json and metrics.jsonl.
"""

import json

import pytest

from scripts import plan as plan_script
from torchtitan.config import parse_args, save_config
from torchtitan.planner.calibration import calibrate, read_run
from torchtitan.planner.cost import MODEL_CONSTANTS
from torchtitan.planner.hardware import GPUS

SHAPE = ["--job.config_file", "train_configs/llama3_8b.toml", "--model.n_layers", "4", "--model.vocab_size", "128256",
         "--training.seq_len", "8192", "--parallelism.data_parallel_shard_degree", "1"]
H100_RUNS = {  # options, tokens/s per GPU, peak reserved GiB
    "noac_b1_eager": (["--activation_checkpoint.mode", "none", "--training.local_batch_size", "1"], 43273, 46.3),
    "noac_b1_compile": (["--activation_checkpoint.mode", "none", "--training.local_batch_size", "1",
                         "--compile.enable"], 49361, 35.3),
    "noac_b1_compile_float8": (["--activation_checkpoint.mode", "none", "--training.local_batch_size", "1",
                                "--compile.enable", "--model.converters", "quantize.linear.float8"], 52585, 31.9),
    "op_b2_compile": (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                       "op", "--training.local_batch_size", "2", "--compile.enable"], 51237, 36.9),
    "full_b4_compile": (["--activation_checkpoint.mode", "full", "--training.local_batch_size", "4",
                         "--compile.enable"], 50291, 45.3),
    "full_b2_eager": (["--activation_checkpoint.mode", "full", "--training.local_batch_size", "2"], 41228, 56.1),
}


def write_run(folder, options, tps, memory_gib, device_type="cuda", windows=2):
    folder.mkdir(parents=True)
    save_config(parse_args([*SHAPE, *options]), str(folder))
    (folder / "run.json").write_text(json.dumps({"world_size": 1, "device_type": device_type,
                                                 "device_name": "NVIDIA H100 80GB HBM3", "torch_version": "2.11"}))
    # The first window holds compilation and warm-up: slower, and left out.
    records = [{"step": 1, "tps": tps / 3, "memory_gib": memory_gib}]
    records += [{"step": 5 * i, "tps": tps, "memory_gib": memory_gib} for i in range(1, windows)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture(scope="module")
def h100_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("h100")
    return {name: write_run(root / name, *spec) for name, spec in H100_RUNS.items()}


def test_efficiency_refitted_to_the_measured_h100_runs(h100_runs):
    runs = [read_run(folder) for folder in h100_runs.values()]
    assert [run.tps_per_gpu for run in runs] == [spec[1] for spec in H100_RUNS.values()]
    fitted, table = calibrate(runs, GPUS["h100"])
    assert fitted["efficiency"] == pytest.approx(0.82)
    assert {k: fitted[k] for k in ("memory_bound_bytes", "compiled_fraction")} == \
        {k: MODEL_CONSTANTS[k] for k in ("memory_bound_bytes", "compiled_fraction")}
    before = max(abs(e["tps_model"] / e["tps_measured"] - 1) for e in table)
    after = max(abs(e["tps_fitted"] / e["tps_measured"] - 1) for e in table)
    assert before > 0.2 and after < 0.1, (before, after)
    assert all(abs(e["memory_predicted_gib"] / e["memory_measured_gib"] - 1) < 0.1 for e in table)


def test_refit_all_moves_every_constant_and_needs_three_runs(h100_runs):
    runs = [read_run(h100_runs[name]) for name in ("noac_b1_eager", "noac_b1_compile", "noac_b1_compile_float8")]
    fitted, table = calibrate(runs, GPUS["h100"], refit_all=True)
    assert all(fitted[name] != MODEL_CONSTANTS[name] for name in MODEL_CONSTANTS)
    assert max(abs(e["tps_fitted"] / e["tps_measured"] - 1) for e in table) < 0.03
    with pytest.raises(Exception, match="three constants need three runs or more, got 2"):
        calibrate(runs[:2], GPUS["h100"], refit_all=True)


def test_calibrated_constants_reach_the_planner(h100_runs, capsys):
    assert plan_script.main(["--calibrate", *map(str, h100_runs.values()), "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert (f"--efficiency 0.82 --memory_bound_bytes {MODEL_CONSTANTS['memory_bound_bytes']:g} "
            f"--compiled_fraction {MODEL_CONSTANTS['compiled_fraction']:g}") in out
    assert plan_script.main(["--calibrate", *map(str, h100_runs.values()), "--gpu", "h100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fitted_constants"]["efficiency"] == pytest.approx(0.82) and len(report["runs"]) == 6
    assert plan_script.main(["--calibrate", str(h100_runs["noac_b1_eager"]), "--gpu", "a100"]) == 2
    assert "ran on NVIDIA H100 80GB HBM3: name the GPU the runs ran on" in capsys.readouterr().err
    argv = ["--predict", "--gpus", "1", "--gpu", "h100", "--json", *SHAPE, *H100_RUNS["noac_b1_eager"][0]]
    assert plan_script.main(argv) == 0
    model = json.loads(capsys.readouterr().out)[0]["tps_per_gpu"]
    assert plan_script.main([*argv, "--efficiency", "0.79"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["tps_per_gpu"] > model


@pytest.mark.parametrize("make, message", [
    (lambda root: root, "is not a finished trainer run: it has no config.toml, run.json, metrics.jsonl"),
    (lambda root: write_run(root / "cpu", [], 1000, 1.0, device_type="cpu"), "ran on cpu"),
    (lambda root: write_run(root / "short", [], 1000, 1.0, windows=1), "fewer than two windows"),
    (lambda root: _without_world_size(write_run(root / "old", [], 1000, 1.0)), "is not the trainer's run record"),
])
def test_runs_that_cannot_calibrate_are_one_line_errors(tmp_path, capsys, make, message):
    assert plan_script.main(["--calibrate", str(make(tmp_path)), "--gpu", "h100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: option --calibrate:") and message in err and len(err.splitlines()) == 1, err


def _without_world_size(folder):
    (folder / "run.json").write_text(json.dumps({"device_type": "cuda"}))
    return folder


# One rank of each layout alone on an H200 (dry runs on real tensors, docs/scaling.md "On one GPU"): options, world
# size, tokens/s per GPU, peak reserved GiB.
EIGHT_B = ["--job.config_file", "train_configs/llama3_8b.toml", "--training.local_batch_size", "2",
           "--activation_checkpoint.mode", "selective"]
FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
          "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
COMPILED_BLOCKS = ["--compile.enable", "--compile.components", "model"]
H200_RANKS = {
    "8b_eager": (EIGHT_B, 8, 9191, 81.3),
    "8b_compile": ([*EIGHT_B, *COMPILED_BLOCKS], 8, 9660, 76.1),
    "8b_compile_float8": ([*EIGHT_B, *COMPILED_BLOCKS, *FLOAT8], 8, 13188, 75.7),
    "8b_compile_no_ac": ([*EIGHT_B, *COMPILED_BLOCKS, "--activation_checkpoint.mode", "none"], 8, 10654, 121.3),
    "8b_compile_full_ac": ([*EIGHT_B, *COMPILED_BLOCKS, "--activation_checkpoint.mode", "full"], 8, 8677, 52.9),
    "70b_tp8": (["--job.config_file", "train_configs/llama3_70b.toml", "--training.local_batch_size", "16",
                 "--training.global_batch_size", "512", "--parallelism.tensor_parallel_degree", "8",
                 *COMPILED_BLOCKS, *FLOAT8], 256, 1478, 69.5),
}


def write_dry_run(folder, options, world_size, tps, reserved_gib, device="NVIDIA H200"):
    folder.mkdir(parents=True)
    save_config(parse_args(options), str(folder))
    memory = {"max_reserved_gib": reserved_gib, "max_allocated_gib": reserved_gib / 1.2} if "NVIDIA" in device \
        else {"max_rss_gib": 1.0}
    (folder / "dry_run.json").write_text(json.dumps({"world_size": world_size, "rank": 0, "device": device,
                                                     "tokens_per_second_per_gpu": tps, "memory": memory}))
    return folder


def test_one_rank_alone_on_one_gpu_calibrates_the_model(tmp_path):
    """Dry runs on real tensors are compared with the model's figure for a rank alone (no communication, no bubble):
    on the H200 ranks the efficiency alone, refitted, takes every layout from up to 25% to within 8%, at a level above
    the one fitted on the 500 W H100 clusters (with attention at FlashAttention-2's published H100 speed, the GEMM
    efficiency absorbs what the uncapped H200 ran faster, attention included; scripts/calibrate_gpu.py measures
    attention itself)."""
    runs = [read_run(write_dry_run(tmp_path / name, *spec)) for name, spec in H200_RANKS.items()]
    assert all(run.alone for run in runs) and runs[-1].world_size == 256 and runs[-1].layout.tp == 8
    fitted, table = calibrate(runs, GPUS["h200"])
    assert MODEL_CONSTANTS["efficiency"] < fitted["efficiency"] <= 1.0
    before = max(abs(e["tps_model"] / e["tps_measured"] - 1) for e in table)
    after = max(abs(e["tps_fitted"] / e["tps_measured"] - 1) for e in table)
    assert before > 0.15 and after < 0.08, (before, after)
    from torchtitan.planner.search import predict
    run = runs[1]
    alone = predict("8B", run.layout, 8192, GPUS["h200"], config=run.config).tps_alone
    assert table[1]["tps_model"] == pytest.approx(alone)


@pytest.mark.parametrize("fake_tensors, device, message", [
    (True, "NVIDIA H200", "a dry run on fake tensors, which times nothing"),
    (False, "AMD EPYC", "not a GPU"),
])
def test_dry_runs_that_cannot_calibrate(tmp_path, fake_tensors, device, message, capsys):
    folder = write_dry_run(tmp_path / "run", EIGHT_B, 8, 9191, 81.3, device=device)
    if fake_tensors:
        (folder / "dry_run.json").write_text(json.dumps({"world_size": 8, "rank": 0, "peak_memory_gib": 60.0}))
    assert plan_script.main(["--calibrate", str(folder), "--gpu", "h200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
