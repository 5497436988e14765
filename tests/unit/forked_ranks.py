"""Run a test's `worker(rank, out_dir)` as ranks forked from a clean server process and collect what each rank saved.

The ranks are forked from multiprocessing's fork server, never from the test process: a spawned rank would import
torch again (seconds each on two cores), and a rank forked from the test process inherits whatever earlier tests left
there. On torch 2.14 that includes autograd's device threads once anything ran a compiled backward ("Unable to
handle autograd's threading in combination with fork-based multiprocessing" at the rank's first backward), a gloo
group waiting for the garbage collector (whose destructor waits forever for threads the fork did not copy), and
DTensor's sharding-propagation caches (tests/unit/test_forked_ranks.py). The server imports torch and the trainer
once, before any test runs in it, and forks every rank from that state.
"""

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torchtitan.train"])


def run_ranks(worker, out_dir: Path, nprocs: int, timeout_s: float, what: str) -> list[dict]:
    """Start `nprocs` ranks of `worker`; each saves its results to `out_dir/rank<R>.pt`. Fails the test (killing the
    ranks) if they run longer than `timeout_s`."""
    join_forked(worker, (str(out_dir),), nprocs, timeout_s, f"{what} workers")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(nprocs)]


def join_forked(worker, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """Fork `nprocs` ranks of `worker(rank, *args)` from the fork server and wait for them; fails the test, killing
    them, after `timeout_s`. `worker` and `args` are pickled: a function of a test module, plain values."""
    workers = mp.start_processes(in_environment, args=(dict(os.environ), worker, *args), nprocs=nprocs, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not workers.join(timeout=1):
        if time.monotonic() > deadline:
            for process in workers.processes:
                process.kill()
            pytest.fail(f"{what} still running after {timeout_s:.0f} s")



def in_environment(rank: int, environment: dict[str, str], worker, *args) -> None:
    """Run `worker(rank, *args)` with the test process's environment as it is now: the fork server's is the one it
    started with, and a test may have set a variable since (a port, a fault to inject)."""
    os.environ.clear()
    os.environ.update(environment)
    worker(rank, *args)
