"""Run a test's `worker(rank, out_dir)` as forked processes and collect what each rank saved."""

import gc
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor.debug import _clear_sharding_prop_cache


def run_ranks(worker, out_dir: Path, nprocs: int, timeout_s: float, what: str) -> list[dict]:
    """Start `nprocs` ranks of `worker`; each saves its results to `out_dir/rank<R>.pt`. Fails the test (killing the
    ranks) if they run longer than `timeout_s`."""
    join_forked(worker, (str(out_dir),), nprocs, timeout_s, f"{what} workers")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(nprocs)]


def join_forked(worker, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """Fork `nprocs` ranks of `worker(rank, *args)` (forked, not spawned: a spawned process would import torch
    again, seconds each on two cores) and wait for them; fails the test, killing them, after `timeout_s`."""
    # Objects that earlier tests left for the garbage collector (a gloo process group among them) are destroyed
    # here, where their threads run: a forked child has none of those threads, and a gloo group's destructor
    # collected there waits for them forever.
    gc.collect()
    workers = mp.start_processes(_without_inherited_garbage, args=(worker, *args), nprocs=nprocs, join=False,
                                 start_method="fork")
    deadline = time.monotonic() + timeout_s
    while not workers.join(timeout=1):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"{what} still running after {timeout_s:.0f} s")


def _without_inherited_garbage(rank: int, worker, *args) -> None:
    """Run the worker with what the parent held out of the child's garbage collection (see join_forked), and with
    none of the parent's DTensor sharding propagations."""
    gc.freeze()
    # torch's sharding-propagation caches (its C++ fast path's and the Python one) hand back an earlier op's output
    # spec, mesh object included, whenever the input meshes compare equal, and DeviceMesh equality ignores the rank
    # and the process group. An entry the parent made under a fake world (test_parallelize's tensor-parallel tests)
    # would put this rank's results on the parent's mesh, rank 0's on every rank (test_forked_ranks).
    _clear_sharding_prop_cache()
    worker(rank, *args)
