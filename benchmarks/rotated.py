"""Rotated tensor parallelism (RTP) against FSDP2 and DDP on the CPU: each rank's peak of live parameter and gradient
bytes, and the step time, on gloo ranks of this machine. docs/parallelism.md, "Rotated tensor parallelism", has the
tables.

    python benchmarks/rotated.py                          # 2 and 4 ranks, the debug model, bf16 compute
    python benchmarks/rotated.py --ranks 2 --rounds 10 --dtype float32

Each rank builds the same model three times (`apply_ddp`, FSDP2's `apply_fsdp`, `apply_rtp`), from the same initial
weights, and trains each on its own batches with fused AdamW (fp32 parameters and optimizer state; the compute dtype
--dtype, gradients reduced in fp32).

Memory: one step of each (after a warm-up step, so that the optimizer state exists) under an allocation tracker, a
TorchDispatchMode that after every op adds up, per storage once, what is alive of: the rank's parameters (local
shards), their gradients, FSDP2's unsharded parameters and gradients, and every tensor a collective or a
point-to-point op sent or received while it lives (FSDP2's gather and reduce buffers, DDP's all-reduced gradients,
RTP's rotating shards and gradient buffers). Not RSS: activations, temporaries and the optimizer state are left out.
Beside each figure, what the memory model predicts for it: the fp32 parameters and gradients, 8 P (DDP) or 8 P / N
of them, plus FSDP2's gathered blocks in backward (planner/memory.py's buffers, (2 P_block + P_head) x p +
P_block x (p + 4)), or for RTP its owned shards (norms whole) and what is in flight at the output layer's backward
(before any gradient exists) or at the embedding's (after all of them: planner/rotated.py,
parameter_and_gradient_peak_bytes).

Time: after two warm-up steps of each, --rounds rounds in which the three take one step each, in turn (the order
rotating every round), so that load from other processes falls on all alike; every step is timed between two
barriers. The medians, and RTP's ratio to each (above 1: RTP slower). On the CPU, gloo's point-to-point transfers run
in its own threads beside the products, which here share the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

METHODS = ("ddp", "fsdp", "rtp")


def build(method: str, args, mesh, ddp_meshes, dtype: str):
    from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
    from torchtitan.distributed.rotated import apply_rtp, init_rotated_weights
    from torchtitan.distributed.utils import init_model_weights, materialize_model
    from torchtitan.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    rotation = None
    if method == "ddp":
        apply_ddp(model, *ddp_meshes, param_dtype=dtype, reduce_dtype="float32")
    elif method == "fsdp":
        apply_fsdp(model, mesh, param_dtype=dtype, reduce_dtype="float32", pp_enabled=False, cpu_offload=False,
                   reshard_policy="default")
    else:
        rotation = apply_rtp(model, mesh, param_dtype=dtype, reduce_dtype="float32")
    cpu = torch.device("cpu")
    materialize_model(model, cpu, cpu_offload=False)
    (init_rotated_weights if rotation else init_model_weights)(model, 0, cpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return model, rotation, optimizer


def train_step(model, rotation, optimizer, inputs, labels) -> None:
    import torch.nn.functional as F

    optimizer.zero_grad()
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    if rotation is not None:
        rotation.sync_replicated_gradients()
    optimizer.step()


class LiveParameterBytes:
    """The peak, over the ops of a region, of the live bytes of parameters, gradients, FSDP2's unsharded ones and
    the tensors communication ops send or receive (each storage once)."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode

        self.model, self.peak = model, 0
        self.fsdp_params = [param for module in model.modules() if isinstance(module, FSDPModule)
                            for state in [module._get_fsdp_state()] if state._fsdp_param_group is not None
                            for param in state._fsdp_param_group.fsdp_params]
        self.comm: dict[int, StorageWeakRef] = {}
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                if func.namespace in ("c10d", "_c10d_functional"):
                    for value in (*args, *(kwargs or {}).values(), result):
                        for tensor in _tensors(value):
                            tracker.comm[tensor.untyped_storage().data_ptr()] = StorageWeakRef(
                                tensor.untyped_storage())
                tracker.update()
                return result

        self.mode = Mode()

    def update(self) -> None:
        from torch.distributed.tensor import DTensor

        storages: dict[int, int] = {}

        def add(tensor) -> None:
            if tensor is None:
                return
            tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

        for param in self.model.parameters():
            add(param)
            add(param.grad)
        for param in self.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                add(unsharded)
                add(unsharded.grad)
        for pointer, reference in list(self.comm.items()):
            if reference.expired():
                del self.comm[pointer]
            else:
                storages.setdefault(pointer, torch.UntypedStorage._new_with_weak_ptr(reference.cdata).nbytes())
        self.peak = max(self.peak, sum(storages.values()))

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def predicted_bytes(method: str, args, world: int, param_bytes: int) -> float:
    """The memory model's live parameter and gradient bytes of one rank (module docstring)."""
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.planner.rotated import parameter_and_gradient_peak_bytes

    if method == "rtp":
        return parameter_and_gradient_peak_bytes(args, world, param_bytes, 4)
    with torch.device("meta"):
        model = Transformer(args)
    params = sum(p.numel() for p in model.parameters())
    if method == "ddp":
        return 8 * params
    block = sum(p.numel() for p in model.layers["0"].parameters())
    head = args.vocab_size * args.dim + args.dim
    return 8 * params / world + (2 * block + head) * param_bytes + block * (param_bytes + 4)


def worker(rank: int, world: int, store: str, options: dict, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models.llama3.args import model_args_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        args = model_args_for(options["flavor"], options["seq_len"])
        mesh = init_device_mesh("cpu", (world,))
        ddp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        generator = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, args.vocab_size, (options["batch"], options["seq_len"] + 1), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        runs = {method: build(method, args, mesh, (ddp_mesh["dp_replicate"], ddp_mesh), options["dtype"])
                for method in METHODS}
        peaks = {}
        for method, (model, rotation, optimizer) in runs.items():
            for _ in range(2):
                train_step(model, rotation, optimizer, inputs, labels)
            with LiveParameterBytes(model) as tracker:
                train_step(model, rotation, optimizer, inputs, labels)
            peaks[method] = tracker.peak
        seconds = {method: [] for method in METHODS}
        for round_ in range(options["rounds"]):
            order = METHODS[round_ % 3:] + METHODS[:round_ % 3]
            for method in order:
                dist.barrier()
                start = time.perf_counter()
                train_step(*runs[method], inputs, labels)
                dist.barrier()
                seconds[method].append(time.perf_counter() - start)
        if rank == 0:
            param_bytes = 2 if options["dtype"] == "bfloat16" else 4
            result = {"ranks": world, "peak_bytes": peaks,
                      "predicted_bytes": {method: predicted_bytes(method, args, world, param_bytes)
                                          for method in METHODS},
                      "median_step_s": {method: statistics.median(times) for method, times in seconds.items()}}
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    options = {"flavor": args.flavor, "seq_len": args.seq_len, "batch": args.batch, "dtype": args.dtype,
               "rounds": args.rounds}
    rows = []
    for world in [int(r) for r in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(worker, args=(world, os.path.join(tmp, "store"), options, out), nprocs=world)
            rows.append(json.loads(Path(out).read_text()))
    mib = 2**20
    print(f"{args.flavor}, {args.batch} x {args.seq_len} tokens per rank, {args.dtype} compute, {args.rounds} rounds")
    print("| ranks | method | live parameter + gradient peak, MiB | predicted, MiB | median step, s | RTP's time / "
          "this |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        for method in METHODS:
            ratio = row["median_step_s"]["rtp"] / row["median_step_s"][method]
            print(f"| {row['ranks']} | {method.upper()} | {row['peak_bytes'][method] / mib:.2f} | "
                  f"{row['predicted_bytes'][method] / mib:.2f} | {row['median_step_s'][method]:.3f} | "
                  f"{ratio:.2f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
