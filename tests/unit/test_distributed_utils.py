"""Device selection and the NCCL environment of `torchtitan.distributed.utils.init_distributed`, checked on the CPU
with the CUDA calls stubbed: which GPU a process takes, and what a GPU run sets before joining the group."""

import os

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.distributed import utils as dist_utils
from torchtitan.errors import UserError
from torchtitan.models.llama3.args import model_args_for
from torchtitan.models.llama3.model import Transformer

NCCL_VARIABLES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.mark.parametrize("local_rank, local_world_size, visible, expected", [
    (3, 8, 8, 3),  # torchrun on a node whose 8 GPUs every process sees
    (3, 1, 1, 0),  # a scheduler that shows each task its own GPU, tasks numbered 0..7 on the node
    (5, 1, 2, 1),  # two GPUs of its own
    (0, 1, 1, 0),
])
def test_cuda_device_index(local_rank, local_world_size, visible, expected):
    assert dist_utils.cuda_device_index(local_rank, local_world_size, visible) == expected


def test_more_processes_than_gpus_is_one_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError, match=r"4 training processes on this node \(NGPU / --nproc_per_node\) but only 2 "
                                        r"GPU\(s\) visible \(CUDA_VISIBLE_DEVICES=0,1\): start at most 2 per node"):
        dist_utils.cuda_device_index(1, 4, 2)


@pytest.fixture
def stubbed_cuda(monkeypatch):
    """A CUDA machine with one visible GPU, as far as init_distributed can tell; returns what it was asked."""
    calls = {}
    monkeypatch.setattr(dist_utils, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("device", device))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.setdefault("backend", backend))
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", *NCCL_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_a_task_that_sees_one_gpu_takes_it_whatever_its_local_rank(stubbed_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    device = dist_utils.init_distributed(60, trace_buf_size=2000, trace_folder="/runs/job")
    assert device == torch.device("cuda", 0) and stubbed_cuda == {"device": device, "backend": "nccl"}


def test_nccl_runs_abort_on_a_failed_collective_and_dump_the_flight_recorder(stubbed_cuda, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # set by the user: kept
    dist_utils.init_distributed(60, trace_buf_size=2000, trace_folder="/runs/job")
    assert {name: os.environ.get(name) for name in NCCL_VARIABLES} == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/job/nccl_trace_rank_"}
    assert dist_utils.nccl_environment(0, "/runs/job") == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                                           "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}


@pytest.fixture
def fake_world():
    """Rank 0 of 4 ranks on the fake backend: collectives return at once."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_cpu_offload_materialises_parameters_on_the_host_and_buffers_on_the_gpu(fake_world):
    """FSDP2 requires offloaded parameters on the CPU at materialisation; the RoPE table stays on the GPU. Checked
    with fake tensors, which may claim a CUDA device on this CPU-only build."""
    mesh = init_device_mesh("cpu", (4,))
    with FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device("meta"):
            model = Transformer(model_args_for("tiny", 32))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        dist_utils.materialize_model(model, torch.device("cuda"), cpu_offload=True)
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert model.rope.device.type == "cuda"


def test_clip_grad_norm_reduces_on_the_process_groups_device(fake_world, monkeypatch):
    """Offloaded gradients live on the CPU while NCCL sends only GPU tensors: every reduction of the norm happens
    on the device given, whatever the gradients' device. The meta device stands in for the GPU here."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    reduced = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: reduced.append(tensor.device)
                        or all_reduce(tensor, *args, **kwargs))
    sharded = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh["dp"], [Shard(0)]))
    sharded.grad = DTensor.from_local(torch.ones(4, 3), mesh["dp"], [Shard(0)])
    plain = torch.nn.Parameter(torch.ones(5))
    plain.grad = torch.ones(5)
    norm = dist_utils.clip_grad_norm_([sharded, plain], 0.0, mesh["pp"], torch.device("meta"))
    assert norm.device.type == "meta" and reduced == [torch.device("meta")]


def test_a_checkpoint_collective_timeout_names_the_checkpoint_timeout(monkeypatch):
    """Inside the checkpoint manager's save, load and close, a timed-out collective names checkpoint.timeout_seconds
    (the group's own timeout), not the training timeout in force around it."""
    timeout = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 1800000ms for recv operation")
    for key, value in (("option", "comm.train_timeout_seconds"), ("seconds", 100), ("joining", False)):
        monkeypatch.setitem(dist_utils._timeout_in_force, key, value)
    with dist_utils.collectives_bounded_by("checkpoint.timeout_seconds", 1800):
        inside = dist_utils.describe_comm_failure(timeout, "step 3")
    outside = dist_utils.describe_comm_failure(timeout, "step 3")
    assert "checkpoint.timeout_seconds = 1800 s" in inside
    assert "comm.train_timeout_seconds = 100 s" in outside


def test_a_dry_run_on_real_tensors_takes_this_machines_gpu(stubbed_cuda):
    """comm.no_fake_tensors: the process plays a rank of the fake world on its own GPU; on fake tensors, the CPU."""
    device = dist_utils.init_distributed(60, fake_rank=(5, 64), fake_on_device=True)
    assert device == torch.device("cuda", 0) and stubbed_cuda == {"device": device, "backend": "fake"}
    stubbed_cuda.clear()
    assert dist_utils.init_distributed(60, fake_rank=(5, 64)) == torch.device("cpu")
    assert stubbed_cuda == {"backend": "fake"}


@pytest.mark.parametrize("user_value", [None, "", "max_split_size_mb:512"])
def test_training_asks_for_expandable_segments_unless_the_user_chose(monkeypatch, user_value):
    from torchtitan import train

    # Set first, so that the test's end restores the variable whatever main() does to it.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_value or "")
    if user_value is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert train.main(["--no_such.option", "1"]) == train.EXIT_USER_ERROR
    expected = "expandable_segments:True" if user_value is None else user_value
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == expected
