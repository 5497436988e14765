"""Device selection and the NCCL environment of `torchtitan.distributed.utils.init_distributed`, checked on the CPU
with the CUDA calls stubbed: which GPU a process takes, and what a GPU run sets before joining the group."""

import os

import pytest
import torch
import torch.distributed as dist

from torchtitan.distributed import utils as dist_utils
from torchtitan.errors import UserError

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
