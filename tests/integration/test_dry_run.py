"""The full-scale dry run (comm.mode = fake_backend): one process plays one rank of a large world on fake tensors.

Checked: the report's memory is exact where it can be derived (parameter and optimizer shards), every parallelism
shows its collectives, both ends of a pipeline are reported, and a layout a cluster would reject is rejected here
with the trainer's one-line error.
"""

import json
from pathlib import Path

import pytest

from tests.integration.harness import REPO, launch

GIB = 2**30
DEBUG = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--job.no_print_config",
         "--debug.seed", "0"]


def dry_run(dump_folder: Path, world_size: int, *args: str, expect_exit: int = 0) -> dict:
    proc = launch(dump_folder, 1, [*DEBUG, "--comm.mode", "fake_backend", "--comm.fake_world_size", str(world_size),
                                   *args], timeout=600)
    assert proc.returncode == expect_exit, f"dry run exited {proc.returncode}:\n{proc.stdout[-5000:]}"
    report_file = dump_folder / "dry_run.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    report["_log"] = proc.stdout
    return report


def collectives(report: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["mesh_dim"]): c for c in report["collectives"]}


@pytest.mark.smoke
def test_debug_model_world_64_pp_fsdp_tp(tmp_path):
    """PP 2 x FSDP 8 x TP 4 on 64 fake ranks: the exact parameter shard, the collectives of each dimension, and
    the memory of both ends of the pipeline."""
    report = dry_run(tmp_path, 64, "--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "256",
                     "--training.local_batch_size", "4", "--comm.fake_rank", "3")
    for key in ("world_size", "rank", "peak_memory_gib", "memory_gib_by_category", "collectives"):
        assert key in report
    assert (report["world_size"], report["rank"], report["pipeline_rank"]) == (64, 3, 0)
    assert report["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 4}
    # Stage 0 holds the embedding (2,304 x 256) and layers 0-2; fp32 master weights, sharded over 8 x 4 ranks.
    dim, ffn, vocab, kv = 256, 768, 2304, 128
    block = 2 * dim * dim + 2 * dim * kv + 3 * dim * ffn
    stage_weights = vocab * dim + 3 * block
    by_category = report["memory_gib_by_category"]
    expected_matrices = stage_weights * 4 / 32 / GIB
    # Norm weights are replicated over TP (sharded over FSDP only): a sliver above 1/32.
    assert expected_matrices <= by_category["parameters"] <= expected_matrices * 1.01
    # Adam keeps two fp32 moments per weight (and a step counter per tensor).
    assert by_category["optimizer_state"] == pytest.approx(2 * by_category["parameters"], rel=1e-3)
    found = collectives(report)
    for kind, dim_name in (("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_gather", "dp_shard_cp"),
                           ("reduce_scatter", "dp_shard_cp"), ("send", "pp"), ("recv", "pp")):
        assert found[(kind, dim_name)]["count"] > 0 and found[(kind, dim_name)]["bytes"] > 0, (kind, dim_name)
    # The embedding's output moves to sequence shards by the GPUs' all-to-all, not gloo's all-gather fallback.
    assert found[("all_to_all", "tp")]["count"] > 0
    other = report["other_end_of_pipeline"]
    assert (other["rank"], other["pipeline_rank"], other["pipeline_stages"]) == (35, 1, [1])
    assert report["pipeline_stage_memory_gib"]["first"] == report["peak_memory_gib"]
    assert report["pipeline_stage_memory_gib"]["last"] == other["peak_memory_gib"]
    assert "Other end of the pipeline, rank 35" in report["_log"]


@pytest.mark.slow
def test_real_tensors_time_one_rank_of_a_large_world(tmp_path):
    """--comm.no_fake_tensors: the last stage's rank of PP 2 x FSDP 8 x TP 4 on 64 ranks runs on real tensors on this
    machine's device (the CPU here), collectives still fake: every step is timed and takes its update, and tokens/s
    per GPU is the rank's share of the tokens over the median step."""
    report = dry_run(tmp_path, 64, "--comm.no_fake_tensors", "--comm.fake_rank", "32",
                     "--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "4",
                     "--training.seq_len", "128", "--training.local_batch_size", "4", "--comm.fake_steps", "3")
    assert (report["rank"], report["pipeline_rank"], report["first_stage"], report["last_stage"]) == (32, 1, False,
                                                                                                       True)
    assert len(report["step_seconds"]) == 3 and min(report["step_seconds"]) > 0
    assert report["median_step_seconds"] == report["step_seconds"][2]
    assert report["tokens_per_second_per_gpu"] == pytest.approx(4 * 128 / (4 * 2) / report["median_step_seconds"])
    assert report["memory"]["max_rss_gib"] > 0
    assert "real tensors" in report["_log"] and "update skipped" not in report["_log"]


def test_8b_on_8_gpus(tmp_path):
    """The shipped 8B preset at its published layout (FSDP 8): fp32 parameters and Adam state are exactly an
    eighth of 8.03B parameters'; the all-gathers move the whole bf16 model (forward, and backward's re-gather)."""
    proc = launch(tmp_path, 1, ["--job.config_file", str(REPO / "train_configs" / "llama3_8b.toml"),
                                "--job.no_print_config", "--comm.mode", "fake_backend", "--comm.fake_world_size", "8"],
                  timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    report = json.loads((tmp_path / "dry_run.json").read_text())
    params = 8_030_261_248
    by_category = report["memory_gib_by_category"]
    assert by_category["parameters"] == pytest.approx(params * 4 / 8 / GIB, rel=1e-3)
    assert by_category["optimizer_state"] == pytest.approx(2 * params * 4 / 8 / GIB, rel=1e-3)
    gathered = collectives(report)[("all_gather", "dp_shard")]["bytes"]
    assert params * 2 <= gathered <= 2 * params * 2 * 1.01
    assert 20 < report["peak_memory_gib"] < 79.6


@pytest.mark.smoke
def test_block_causal_under_context_parallelism_is_traced(tmp_path):
    """Packed documents under CP 2 x FSDP 2: each of the debug model's 6 layers gathers its keys and values over the
    CP group in forward (one call for both, after one gather of the document ids and positions) and reduce-scatters
    their gradients in backward, as the planner counts them (the dry run's batches are one document per sequence: a
    tokenizer-free run has no documents to find)."""
    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.planner.cost import Layout, sequence_collectives

    report = dry_run(tmp_path, 4, "--model.attention_mask", "block_causal", "--parallelism.context_parallel_degree",
                     "2", "--parallelism.data_parallel_shard_degree", "2", "--training.seq_len", "256",
                     "--training.local_batch_size", "2")
    found = collectives(report)
    layout = Layout(dp_replicate=1, dp_shard=2, tp=1, pp=1, cp=2, schedule=None, stages_per_rank=1, local_batch=2,
                    microbatch=2, ac="none", float8=False, compile=False, async_tp=False, document_length=256.0)
    predicted = sequence_collectives(model_args_for("debugmodel", 256), layout, 256)
    assert predicted[("reduce_scatter", "cp")][0] == 6 and predicted[("all_gather", "cp")][0] == 6 + 1
    for key, (calls, size) in predicted.items():
        assert (found[key]["count"], found[key]["bytes"]) == (calls, size), key
    assert report["peak_memory_gib"] > 0


@pytest.mark.parametrize("args, message", [
    (["--comm.fake_rank", "8"], "option comm.fake_rank: 8 is not a rank of a world of 8"),
    (["--parallelism.tensor_parallel_degree", "3"], "option parallelism"),
    (["--parallelism.tensor_parallel_degree", "8", "--parallelism.enable_async_tensor_parallel"],
     "option parallelism.enable_async_tensor_parallel"),
    (["--comm.fake_gpu", "h900"], "option comm.fake_gpu: unknown GPU 'h900'"),
    (["--comm.no_fake_tensors", "--comm.fake_steps", "0"], "option comm.fake_steps: 0 must be a positive integer"),
    # Split backwards run torch.autograd.grad, whose graph torch's module tracker cannot hook (it raised mid-step).
    (["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
     "option comm.mode = 'fake_backend' (the dry run): does not compose with a split-backward pipeline schedule"),
])
def test_bad_layouts_are_one_line_errors(tmp_path, args, message):
    report = dry_run(tmp_path, 8, *args, expect_exit=2)
    errors = [line for line in report["_log"].splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], report["_log"][-3000:]
    assert "Traceback" not in report["_log"]


def test_out_of_memory_is_reported_after_the_report(tmp_path):
    """A layout that does not fit the GPU fails as the cluster would, after writing what it measured."""
    report = dry_run(tmp_path, 8, "--training.seq_len", "8192", "--training.local_batch_size", "128",
                     "--activation_checkpoint.mode", "none", expect_exit=2)
    assert report["peak_memory_gib"] > 79.6
    assert "more than the 79.6 GiB of one h100" in report["_log"]


@pytest.mark.slow
def test_compiled_layout_is_judged_by_its_compiled_memory(tmp_path):
    """8B on 8 without AC: the eager trace exceeds an H100 (80.5 GiB); compiled blocks and loss save less, and the
    analytic compiled peak (54 GiB), which the report adds, lets the run through with a warning."""
    proc = launch(tmp_path, 1, ["--job.config_file", str(REPO / "train_configs" / "llama3_8b.toml"),
                                "--job.no_print_config", "--comm.mode", "fake_backend", "--comm.fake_world_size", "8",
                                "--activation_checkpoint.mode", "none", "--compile.enable"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["peak_memory_gib"] > 79.6 > report["compiled_estimate_gib"] > 40
    assert "compiled, the analytic model gives" in proc.stdout


def test_world_size_must_be_given(tmp_path):
    proc = launch(tmp_path, 1, [*DEBUG, "--comm.mode", "fake_backend"], env={"NGPU": ""})
    assert proc.returncode == 2
    assert "option comm.fake_world_size: not set" in proc.stdout


def test_cpu_offload_on_the_gpu_target(tmp_path):
    """FSDP's CPU offload takes the GPU's path (parameters materialised in host memory, pinned) at world 8."""
    report = dry_run(tmp_path, 8, "--training.enable_cpu_offload")
    assert report["offloaded_to_host"] == ["parameters", "gradients", "optimizer_state"]
    by_category = report["memory_gib_by_category"]
    assert by_category["parameters"] > 0
    # The device's own peak leaves out what the host holds: the parameter shards and the optimizer state are held
    # through the whole measured step, so at the device's peak the total was at least the device's share plus them,
    # and the total never exceeds its own peak. And at the total's peak the device held what was not on the host.
    held = by_category["parameters"] + by_category["optimizer_state"]
    device = report["device_peak_memory_gib"]
    assert device <= report["peak_memory_gib"] - held + 1e-9
    assert device >= report["peak_memory_gib"] - sum(by_category[name] for name in report["offloaded_to_host"]) - 1e-9
    assert report["max_device_peak_memory_gib"] == device


def test_out_of_memory_verdict_counts_the_gpus_memory_only():
    """Under CPU offload the host holds the shards and the optimizer state: a rank whose total peak exceeds the GPU
    but whose device peak does not fits (the verdict compared the total with the GPU)."""
    from torchtitan.dry_run import check_fits
    from torchtitan.errors import UserError
    from torchtitan.planner.hardware import GPUS

    gpu = GPUS["h100"]
    check_fits({"max_peak_memory_gib": 120.0, "max_device_peak_memory_gib": 60.0}, gpu)
    with pytest.raises(UserError, match=r"a rank needs 92.9 GiB of GPU memory at its peak \(80.0 GiB of tensors .* "
                                        r"more than the 79.6 GiB"):
        check_fits({"max_peak_memory_gib": 80.0, "max_device_peak_memory_gib": 80.0}, gpu)


def test_out_of_memory_verdict_adds_the_planners_headroom():
    """Tensors that fit the GPU alone do not fit with what the GPU holds beside them: the allocator's reserve
    (15.5% of the tensors), the CUDA context (0.5 GiB) and 0.25 GiB of NCCL buffers per communicator; the planner
    compares the same sum with the GPU's memory."""
    from torchtitan.dry_run import check_fits
    from torchtitan.errors import UserError
    from torchtitan.planner.hardware import GPUS, headroom

    gpu = GPUS["h100"]
    layout = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}  # world, FSDP and TP communicators
    extra = headroom(60.0, gpu, layout)
    assert (extra.allocator_gib, extra.cuda_context_gib, extra.nccl_gib) == pytest.approx((9.3, 0.5, 0.75))
    # 68.3 GiB of tensors: 68.3 x 1.155 + 0.5 + 0.75 = 80.1 GiB, over the 79.6 of an H100.
    with pytest.raises(UserError, match=r"a rank needs 80.1 GiB .*68.3 GiB of tensors \+ 10.6 allocator reserve "
                                        r"\+ 0.5 CUDA context \+ 0.8 NCCL buffers"):
        check_fits({"max_peak_memory_gib": 68.3, "max_device_peak_memory_gib": 68.3, "layout": layout}, gpu)
    check_fits({"max_peak_memory_gib": 67.8, "max_device_peak_memory_gib": 67.8, "layout": layout}, gpu)


@pytest.mark.parametrize("method", ["loco", pytest.param("error_feedback", marks=pytest.mark.slow),
                                    pytest.param("qsdp", marks=pytest.mark.slow),
                                    pytest.param("none", marks=pytest.mark.slow)])
def test_a_rank_that_compresses_gradients_is_dry_run(tmp_path, method):
    """FSDP 8 with each gradient compression: every FSDP module (6 blocks, the embedding, and the final norm with the
    output layer, sharded together) reduces its gradients once a step, in one exchange of codes (an all-to-all)
    that covers all its parameters, as a real run does. The memory tracker had split the norm and output layer's
    group into one reduction per module: the first, before the norm's gradient existed, was refused by the
    compressed reduce-scatter (a row without the norm's values), and without compression it was a reduce-scatter
    too many, with the output layer gathered again."""
    report = dry_run(tmp_path, 8, "--comm.gradient_compression", method, "--training.seq_len", "128",
                     "--training.local_batch_size", "2")
    found = collectives(report)
    exchange = ("reduce_scatter" if method == "none" else "all_to_all", "dp_shard")
    assert found[exchange]["count"] == 8, report["collectives"]
    assert method == "none" or ("reduce_scatter", "dp_shard") not in found
    # Forward gathers all 8 modules; backward gathers again all but the output layer's group (kept gathered).
    assert found[("all_gather", "dp_shard")]["count"] == 15


@pytest.mark.slow
def test_flexdemo_exchanges_its_components_once_per_step(tmp_path):
    """FlexDeMo's one exchange per step is one all-gather across replicas of each tile's top 32 DCT coefficients
    (6 bytes each) of the rank's shard (rows halved by FSDP 2), in place of gradient all-reduces."""
    import torch

    from torchtitan.components.optimizers.flexdemo import payload_bytes
    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.models.llama3.model import Transformer

    report = dry_run(tmp_path, 4, "--parallelism.data_parallel_replicate_degree", "2", "--optimizer.name", "FlexDeMo")
    exchange = collectives(report)[("all_gather", "dp_replicate")]
    assert exchange["count"] == 1
    with torch.device("meta"):
        model = Transformer(model_args_for("debugmodel", 256))
    shards = [(p.shape[0] // 2, *p.shape[1:]) for p in model.parameters()]  # every first dimension is even
    assert exchange["bytes"] == 2 * sum(payload_bytes(shape, 64, 32) for shape in shards)  # both replicas' payloads
    assert not any(c["mesh_dim"] == "dp_replicate" and c["kind"] != "all_gather" for c in report["collectives"])


@pytest.mark.parametrize("shard, cp, ac, method, rotate", [
    # K/V all-gathered (the default), of the KV heads TP left on the rank.
    (2, 2, "none", "allgather_kv", "allgather"),
    pytest.param(1, 4, "full", "allgather_kv", "allgather", marks=pytest.mark.slow),
    # Per-op AC saves the reduce-scatters' and attention's outputs, not the gathered inputs: backward gathers them
    # again (TP's hidden states and CP's keys and values).
    (2, 2, "op", "allgather_kv", "allgather"),
    # The ring: each call gathers the keys and values expanded to the query heads.
    pytest.param(1, 4, "full", "ring", "allgather", marks=pytest.mark.slow),
    # The ring's other rotate method: each call passes one chunk on cp - 1 times instead of gathering them all.
    pytest.param(1, 4, "full", "ring", "alltoall", marks=pytest.mark.slow),
])
def test_planner_counts_the_sequence_collectives_the_dry_run_issues(tmp_path, shard, cp, ac, method, rotate):
    """TP's and CP's collectives of one step, calls and bytes, as the planner's cost model counts them and as the
    dry run sees them: CP's ring attention issues its collectives inside DTensor's dispatch (counted only because
    the counter lets DTensor run first), and shards each step's batch in place (so each step needs a batch of its
    own, or the measured step is shorter by a factor cp)."""
    from torchtitan.models.llama3.args import model_args_for
    from torchtitan.planner.cost import Layout, sequence_collectives

    report = dry_run(tmp_path, 8, "--parallelism.data_parallel_shard_degree", str(shard),
                     "--parallelism.context_parallel_degree", str(cp), "--parallelism.tensor_parallel_degree", "2",
                     *(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
                       if ac == "op" else ["--activation_checkpoint.mode", ac]),
                     "--training.seq_len", "256", "--training.local_batch_size", "8",
                     "--parallelism.context_parallel_method", method,
                     "--parallelism.context_parallel_rotate_method", rotate)
    layout = Layout(dp_replicate=1, dp_shard=shard, tp=2, pp=1, cp=cp, schedule=None, stages_per_rank=1,
                    local_batch=8, microbatch=8, ac=ac, float8=False, compile=False, async_tp=False,
                    cp_method=method, cp_rotate=rotate)
    predicted = sequence_collectives(model_args_for("debugmodel", 256), layout, 256)
    found = collectives(report)
    sequence_parallel = {("all_gather", "tp"), ("reduce_scatter", "tp")}
    assert set(predicted) == {key for key in found if key[1] == "cp"} | sequence_parallel
    for key, (calls, size) in predicted.items():
        assert (found[key]["count"], found[key]["bytes"]) == (calls, size), key
