"""`validate_parallelism` rejects layouts that would fail or silently do nothing, before anything is built."""

import pytest

from torchtitan.config import parse_args
from torchtitan.config.compatibility import check_composition, setup_of
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.parallelize import validate_parallelism


def start_up(args, dims: ParallelDims, config, device_type: str) -> None:
    """The trainer's start-up checks: the pairs of features, then the layout against the model's shapes."""
    check_composition(setup_of(config, dims, device_type))
    validate_parallelism(args, dims, config, device_type)


def test_async_tp_without_compiling_the_model_is_an_error():
    config = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32", "--parallelism.tensor_parallel_degree",
                         "2", "--parallelism.enable_async_tensor_parallel", "--compile.enable"])
    config.compile.components = ["loss"]
    dims = ParallelDims.from_config(config.parallelism, 2)
    with pytest.raises(UserError, match=r"option parallelism.enable_async_tensor_parallel: does not compose with "
                                        r"compile.enable = false \(or 'model' not in compile.components\) .*set "
                                        r"compile.enable = true with 'model' in compile.components"):
        start_up(model_args_for("tiny", 32), dims, config, "cuda")
    config.compile.components = ["model", "loss"]
    start_up(model_args_for("tiny", 32), dims, config, "cuda")


def test_cpu_offload_needs_gpus_and_fsdp():
    config = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32", "--training.enable_cpu_offload"])
    args = model_args_for("tiny", 32)
    with pytest.raises(UserError, match=r"option training.enable_cpu_offload: does not compose with a run on the CPU"):
        start_up(args, ParallelDims.from_config(config.parallelism, 2), config, "cpu")
    with pytest.raises(UserError, match=r"option training.enable_cpu_offload: does not compose with .*\(no FSDP\)"):
        start_up(args, ParallelDims.from_config(config.parallelism, 1), config, "cuda")
    start_up(args, ParallelDims.from_config(config.parallelism, 2), config, "cuda")


def test_cpu_offload_refuses_precomputed_float8_scales():
    """torchao all-reduces the amax of the weight shards where they are: in host memory under offload, over an
    NCCL-only group (the 405B preset precomputes its scales)."""
    with pytest.raises(UserError, match=r"^option training.enable_cpu_offload: does not compose with "
                                        r"quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp .*turn one "
                                        r"of the two off$"):
        parse_args(["--job.config_file", "train_configs/llama3_405b.toml", "--training.enable_cpu_offload"])
    config = parse_args(["--job.config_file", "train_configs/llama3_405b.toml"])
    config.training.enable_cpu_offload = True
    assert config.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
    dims = ParallelDims.from_config(config.parallelism, 512)
    args = model_args_for("405B", config.training.seq_len)
    with pytest.raises(UserError, match=r"^option training.enable_cpu_offload: does not compose with "
                                        r"quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp .*turn one "
                                        r"of the two off$"):
        start_up(args, dims, config, "cuda")
    config.quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp = False
    start_up(args, dims, config, "cuda")


def test_tensor_parallel_embedding_gradient_is_the_ranks_slice():
    """A row-split embedding's gradient comes out of DTensor's backward whole (vocabulary x dim on every rank); the
    column split keeps it to the rank's slice."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.distributed.tensor_parallel import apply_tp
    from torchtitan.models.llama3.model import Transformer

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        args = model_args_for("tiny", 32)
        model = Transformer(args)
        model.init_weights(seed=0)
        apply_tp(model, init_device_mesh("cpu", (2,)), loss_parallel=False, async_tp=False)
        tokens = torch.randint(0, args.vocab_size, (2, 32))
        model(tokens).sum().backward()
        grad = model.tok_embeddings.weight.grad
        assert grad.placements == (Shard(1),)
        assert grad.to_local().shape == (args.vocab_size, args.dim // 2)
    finally:
        dist.destroy_process_group()


ROTATED = ["--parallelism.data_parallel_shard_method", "rotated"]


@pytest.mark.parametrize("options, message", [
    (["--model.converters", "quantize.linear.float8"], "model.converters = quantize.linear.float8"),
    (["--comm.gradient_compression", "loco"], r"comm.gradient_compression \(loco, error_feedback, qsdp\)"),
    (["--comm.weight_quantization", "qsdp"], "comm.weight_quantization = 'qsdp'"),
    (["--training.enable_cpu_offload"], "training.enable_cpu_offload"),
    (["--parallelism.fsdp_reshard_after_forward", "never"],
     "parallelism.fsdp_reshard_after_forward = 'always' or 'never'"),
])
def test_rotated_refuses_options_when_they_are_read(options, message):
    """Pairs the options alone decide fail in parse_args, naming both options and FSDP as what to use instead."""
    base = ["--model.flavor", "tiny", "--training.seq_len", "32", *options]
    with pytest.raises(UserError, match=rf"^option parallelism.data_parallel_shard_method = 'rotated': does not "
                                        rf"compose with {message} \(.*\); "):
        parse_args([*base, *ROTATED])
    parse_args(base)


def test_flexdemo_refuses_rotated():
    with pytest.raises(UserError, match=r"^option optimizer.name = 'FlexDeMo': does not compose with "
                                        r"parallelism.data_parallel_shard_method = 'rotated' .*use "
                                        r"parallelism.data_parallel_shard_method = 'fsdp' with FlexDeMo$"):
        parse_args(["--optimizer.name", "FlexDeMo", "--parallelism.data_parallel_replicate_degree", "2", *ROTATED])


@pytest.mark.parametrize("world, degrees, message", [
    (1, [], r"data_parallel_shard_degree x context_parallel_degree = 1 \(no FSDP\) .*set "
            r"data_parallel_shard_degree to 2 or more$"),
    (4, ["--parallelism.data_parallel_replicate_degree", "2"], r"data_parallel_replicate_degree > 1 .*rotate over "
     r"all data-parallel ranks \(data_parallel_replicate_degree = 1\), or use data_parallel_shard_method = 'fsdp' "
     r"for HSDP or DDP$"),
    (4, ["--parallelism.tensor_parallel_degree", "2"], r"tensor_parallel_degree > 1 .*use "
     r"data_parallel_shard_method = 'fsdp' with TP, or rotate without TP \(tensor_parallel_degree = 1\)$"),
])
def test_rotated_refuses_layouts_at_start_up(world, degrees, message):
    config = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32", *degrees, *ROTATED])
    dims = ParallelDims.from_config(config.parallelism, world)
    with pytest.raises(UserError, match=rf"^option parallelism.data_parallel_shard_method = 'rotated': does not "
                                        rf"compose with {message}"):
        start_up(model_args_for("tiny", 32), dims, config, "cuda")
    config.parallelism.data_parallel_shard_method = "fsdp"
    start_up(model_args_for("tiny", 32), dims, config, "cuda")


@pytest.mark.parametrize("world, degrees", [
    (2, []), (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]),
    (4, ["--parallelism.pipeline_parallel_degree", "2"]),
    (8, ["--parallelism.context_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]),
])
def test_rotated_composes_with_data_context_and_pipeline_parallelism(world, degrees):
    """The ring is FSDP's shard group, dp_shard x cp: a context-parallel group alone rotates too."""
    config = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32", *degrees, *ROTATED])
    start_up(model_args_for("tiny", 32), ParallelDims.from_config(config.parallelism, world), config, "cpu")
