"""`validate_parallelism` rejects layouts that would fail or silently do nothing, before anything is built."""

import pytest

from torchtitan.config import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.parallelize import validate_parallelism


def test_async_tp_without_compiling_the_model_is_an_error():
    config = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32", "--parallelism.tensor_parallel_degree",
                         "2", "--parallelism.enable_async_tensor_parallel", "--compile.enable",
                         "--compile.components", "loss"])
    dims = ParallelDims.from_config(config.parallelism, 2)
    with pytest.raises(UserError, match=r"option parallelism.enable_async_tensor_parallel: .*compile.components = "
                                        r"\['loss'\] does not compile them: add 'model'"):
        validate_parallelism(model_args_for("tiny", 32), dims, config, "cuda")
    config.compile.components = ["model", "loss"]
    validate_parallelism(model_args_for("tiny", 32), dims, config, "cuda")


def test_cpu_offload_needs_gpus_and_fsdp():
    config = parse_args(["--model.flavor", "tiny", "--training.seq_len", "32", "--training.enable_cpu_offload"])
    args = model_args_for("tiny", 32)
    with pytest.raises(UserError, match=r"option training.enable_cpu_offload: .*this run is on the CPU"):
        validate_parallelism(args, ParallelDims.from_config(config.parallelism, 2), config, "cpu")
    with pytest.raises(UserError, match=r"option training.enable_cpu_offload: .*does not shard with FSDP"):
        validate_parallelism(args, ParallelDims.from_config(config.parallelism, 1), config, "cuda")
    validate_parallelism(args, ParallelDims.from_config(config.parallelism, 2), config, "cuda")
