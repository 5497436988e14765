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
