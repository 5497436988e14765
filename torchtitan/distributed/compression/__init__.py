"""Communication-efficient FSDP: low-bit gradient reduce-scatter (LoCo, classic error feedback, QSDP) and weight
all-gather (QSDP), each installed through FSDP2's own hooks after `fully_shard` by `apply_compression`.

One file per wire format: quantize.py (blockwise codes + scales), hadamard.py (the optional rotation), loco.py (the
compressed reduce-scatter and its compensations: LoCo's and classic error feedback), qsdp.py (the quantized
all-gather). `GRADIENT_COMPRESSION` maps each `comm.gradient_compression` value to its method; `CompressionState`
makes the compensation state part of the optimizer's checkpointed state.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from torchtitan.config.job_config import Comm, JobConfig
from torchtitan.distributed import torch_compat
from torchtitan.distributed.compression.loco import (LOCO_ERROR_BITS, CompressedReduceScatter, ErrorFeedback, LoCo,
                                                     LoCoOptions)
from torchtitan.distributed.compression.qsdp import QuantizedAllGather
from torchtitan.distributed.compression.quantize import BLOCK, VALID_BITS, decode
from torchtitan.distributed.utils import placed_like
from torchtitan.errors import UserError


@dataclass(frozen=True)
class GradientMethod:
    """One `comm.gradient_compression` method: its rounding, the compensation state it keeps per FSDP module (None:
    none), and that state's bytes per value of the module's unsharded gradient, on every rank (what memory
    predictions add: the state covers everything a rank sends, so it is not divided by the FSDP degree), what its
    reduce-scatter holds at its peak per value of the module's unsharded gradient by gradient_bits, beyond FSDP's
    input buffer and with the module's new (staged) state, and the dataclass of its own options
    ([comm.<options.TABLE>], read as `comm.<TABLE>`; None: it has none)."""
    stochastic: bool
    compensation: Callable[[Comm, list[int]], ErrorFeedback | LoCo] | None
    state_bytes_per_value: float
    reduction_bytes_per_value: dict[int, float]
    options: type | None = None


GRADIENT_COMPRESSION: dict[str, GradientMethod] = {
    "loco": GradientMethod(stochastic=False,
                           compensation=lambda comm, segments: LoCo(comm.loco.beta, comm.loco.reset_interval,
                                                                    segments),
                           # 8-bit codes and one bfloat16 scale per block
                           state_bytes_per_value=LOCO_ERROR_BITS / 8 + 2 / BLOCK,
                           reduction_bytes_per_value={4: 19.6, 8: 19.1}, options=LoCoOptions),
    # 8-bit: 18 + 4 / W bytes (a row more at the peak), 20.0 at W = 2, the most.
    "error_feedback": GradientMethod(stochastic=False, compensation=lambda comm, segments: ErrorFeedback(),
                                     state_bytes_per_value=4.0, reduction_bytes_per_value={4: 21.1, 8: 20.0}),
    "qsdp": GradientMethod(stochastic=True, compensation=None, state_bytes_per_value=0.0,
                           reduction_bytes_per_value={4: 20.1, 8: 20.1}),
}
"""The reductions' bytes, by reading `CompressedReduceScatter.__call__` and measured with torch's MemTracker on 2, 4
and 8 ranks, the input and output left out (tests/unit/test_compression.py keeps them true on 2): the compensated
rows, the quantizer's codes and restored values, the new state, the payload sent and the one received, and the
decoded rows (fp32 each, 4 bytes per value); QSDP's stochastic rounding holds its int64 hashes where the others hold
a state."""


def method_options() -> dict[str, type]:
    """{table: options dataclass} of the gradient compression methods: the config's [comm.<table>] tables."""
    return {method.options.TABLE: method.options for method in GRADIENT_COMPRESSION.values()
            if method.options is not None}


def compensation_bytes_per_value(config: JobConfig) -> float:
    """Bytes per value of each rank's unsharded (local, after TP) gradient that the configured gradient compression
    keeps between steps: 0 without one."""
    method = GRADIENT_COMPRESSION.get(config.comm.gradient_compression)
    return method.state_bytes_per_value if method else 0.0


# What encoding a row holds at its peak per value (fp32): the rows' absolute values or the codes, the restored
# values, QSDP's hashes; measured as the reductions' (a QSDP reduction holds 20 bytes per value beyond its input).
QUANTIZE_BYTES_PER_VALUE = 20.0


def weight_code_bytes_per_value(config: JobConfig) -> float:
    """Bytes per value of a rank's parameter shard that QSDP's weight all-gather keeps as codes between a module's
    first gather of a step and the optimizer step: 0 without it."""
    if config.comm.weight_quantization != "qsdp":
        return 0.0
    return config.comm.weight_bits / 8 + 2 / BLOCK


def reduction_bytes_per_value(config: JobConfig) -> float:
    """Bytes per value of a module's unsharded (local) gradient that the configured gradient compression's
    reduce-scatter holds at its peak beyond FSDP's input buffer (its new state included; a reduce dtype below fp32
    adds the rows' fp32 copy): 0 without one."""
    method = GRADIENT_COMPRESSION.get(config.comm.gradient_compression)
    if method is None:
        return 0.0
    upcast = 4.0 if config.training.mixed_precision_reduce != "float32" else 0.0
    return method.reduction_bytes_per_value[config.comm.gradient_bits] + upcast


def validate_compression(config: JobConfig) -> None:
    """One clear error for a bad value (pairs of features that do not compose: config/compatibility.py)."""
    optimizer = config.optimizer
    if optimizer.name == "FlexDeMo":
        demo = optimizer.flexdemo
        if not 1 <= demo.chunk_size <= 128:
            raise UserError(f"option optimizer.flexdemo.chunk_size: {demo.chunk_size} must be in [1, 128] "
                            f"(a coefficient's index in its tile of up to chunk_size x chunk_size travels as int16)")
        if not 1 <= demo.topk <= demo.chunk_size ** 2:
            raise UserError(f"option optimizer.flexdemo.topk: {demo.topk} must be in [1, chunk_size^2 = "
                            f"{demo.chunk_size ** 2}] (the coefficients of a tile)")
        if not 0.0 <= demo.momentum_decay < 1.0:
            raise UserError(f"option optimizer.flexdemo.momentum_decay: {demo.momentum_decay} must be in [0, 1)")
    comm = config.comm
    if not 0.0 <= comm.loco.beta < 1.0:
        raise UserError(f"option comm.loco.beta: {comm.loco.beta} must be in [0, 1)")
    if comm.loco.reset_interval < 0:
        raise UserError(f"option comm.loco.reset_interval: {comm.loco.reset_interval} must be 0 (never) or a "
                        f"positive number of steps")
    for option, bits in (("gradient_bits", comm.gradient_bits), ("weight_bits", comm.weight_bits)):
        if bits not in VALID_BITS:
            raise UserError(f"option comm.{option}: {bits} is not one of {', '.join(map(str, VALID_BITS))}")
    if comm.quantization_rotation != "none" and comm.gradient_compression == comm.weight_quantization == "none":
        raise UserError(f"option comm.quantization_rotation: {comm.quantization_rotation!r} rotates what is "
                        f"quantized, and nothing is: set comm.gradient_compression or comm.weight_quantization")


def apply_compression(model: nn.Module, config: JobConfig) -> None:
    """Give every FSDP module of `model` its own compressed collectives (each reduce-scatter owns its module's
    compensation state). Tensor, pipeline and context parallelism compose as with plain FSDP: the hooks see this
    rank's local shards and the data-parallel group only."""
    comm = config.comm
    if comm.gradient_compression == "none" and comm.weight_quantization == "none":
        return
    rotate = comm.quantization_rotation == "hadamard"
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule) or not fsdp_param_groups(module):
            continue
        groups = fsdp_param_groups(module)
        if len(groups) > 1:
            # torch 2.13's set_custom_reduce_scatter/all_gather take one collective for a module's groups, which
            # have meshes of their own (fully_shard's shard_placement_fn): not one layout to compress.
            option = ("comm.gradient_compression" if comm.gradient_compression != "none"
                      else "comm.weight_quantization")
            raise UserError(f"option {option}: FSDP module {name or '<root>'} has {len(groups)} parameter groups "
                            f"(per-parameter meshes), and compressed collectives need one per FSDP module; shard "
                            f"it with one mesh, or set {option} = none")
        group, = groups
        # FSDP's flat buffers concatenate the module's parameters, each padded to an equal shard per rank.
        segments = [p.padded_sharded_param_size.numel() for p in group.fsdp_params]
        if comm.gradient_compression != "none":
            method = GRADIENT_COMPRESSION[comm.gradient_compression]
            compensation = method.compensation(comm, segments) if method.compensation else None
            module.set_custom_reduce_scatter(CompressedReduceScatter(
                comm.gradient_bits, compensation, stochastic=method.stochastic, rotate=rotate, segments=segments))
        if comm.weight_quantization == "qsdp":
            module.set_custom_all_gather(QuantizedAllGather(comm.weight_bits, rotate=rotate, segments=segments,
                                                            fsdp_params=group.fsdp_params))


def fsdp_param_groups(module: FSDPModule) -> list:
    """The parameter groups of one FSDP module (torch 2.13 holds a list; earlier torch one group or None). Empty on a
    torch without FSDP's state accessor, where no compressed collective can be installed (refused at start-up)."""
    if torch_compat.lookup("FSDPModule._get_fsdp_state") is None:
        return []
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []


def _param_groups(model_parts: list[nn.Module]):
    """Each FSDP parameter group of the model parts once: modules sharded together (fully_shard of a list, as the
    final norm and the output layer are) share one group."""
    seen = set()
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                for group in fsdp_param_groups(module):
                    if id(group) not in seen:
                        seen.add(id(group))
                        yield group


def compression_stats(model_parts: list[nn.Module]) -> dict[str, int]:
    """Bytes this rank has sent through the compressed collectives, and what full precision would have sent."""
    stats = {"sent_bytes": 0, "uncompressed_bytes": 0}
    for group in _param_groups(model_parts):
        for comm in (getattr(group, "_reduce_scatter_comm", None), getattr(group, "_all_gather_comm", None)):
            if isinstance(comm, (CompressedReduceScatter, QuantizedAllGather)):
                stats["sent_bytes"] += comm.sent_bytes
                stats["uncompressed_bytes"] += comm.uncompressed_bytes
    return stats


def compensation_state_bytes(model_parts: list[nn.Module]) -> int:
    """Bytes of compensation state (error feedback's or LoCo's) this rank will hold once the first step has run:
    per FSDP module, one row per rank of the data-parallel group, each the length of the module's local shards."""
    total = 0.0
    for group in _param_groups(model_parts):
        comm = group._reduce_scatter_comm
        if isinstance(comm, CompressedReduceScatter) and comm.compensation is not None:
            world = group.mesh_info.shard_process_group.size()
            total += world * sum(comm.segments) * comm.compensation.bytes_per_value(comm.segments)
    return round(total)


def require_compensation_fits(config: JobConfig, state_bytes: int, other_bytes: int, capacity: int | None,
                              where: str) -> None:
    """Refuse, before training, a layout whose compensation state (`state_bytes`) and the rank's sharded parameters
    and gradients (`other_bytes`) exceed `capacity` bytes of `where` (the device, or this process's share of host
    memory); None: unknown, nothing checked."""
    if not state_bytes or capacity is None or state_bytes + other_bytes <= capacity:
        return
    gib = 2 ** 30
    raise UserError(
        f"option comm.gradient_compression: {config.comm.gradient_compression} keeps {state_bytes / gib:.1f} GiB "
        f"of compensation state per rank (its whole local gradient, not sharded), which with the "
        f"{other_bytes / gib:.1f} GiB of parameters and gradients exceeds the {capacity / gib:.1f} GiB of {where}; "
        f"use loco (8-bit state) instead of error_feedback, qsdp (no state), more tensor or pipeline parallelism, "
        f"or none")


# Keys of state saved verbatim for an exact resume into the same layout (see CompressionState).
EXACT = "exact."


def replica_suffix(replicate_group: dist.ProcessGroup | None) -> str:
    """`.replica<r>of<R>`: names state that differs between data-parallel replicas (FlexDeMo's momenta, and the
    compensation state of FSDP within each replica), which DCP would otherwise keep once for all replicas."""
    if replicate_group is None:
        return ".replica0of1"
    return f".replica{dist.get_rank(replicate_group)}of{dist.get_world_size(replicate_group)}"


class CompressionState(Stateful):
    """The compensation state of the compressed reduce-scatters (error feedback's residuals, LoCo's errors and its
    step count), checkpointed with the optimizer state.

    Saving has no effect on training: the live state is read, never changed. A checkpoint holds it twice:
    - verbatim (`exact.compression.<first parameter of the module><replica suffix>`): every rank's own state (LoCo's
      codes, error feedback's fp32 residuals) as one DTensor sharded over the module's mesh. A resume into the same
      layout restores it bit for bit, so a resumed run repeats the uninterrupted one.
    - per parameter (`compression.<parameter>`): what all ranks together owe each shard, sharded like the
      parameter, so that it reshards to any layout as the optimizer state does. Where the verbatim state does not fit
      the layout (another data-parallel degree), each shard's total is loaded into the shard's own rank. The ranks'
      states travel to each shard's owner as 8-bit codes (one all-to-all; the data-parallel group is the link that
      gradient compression spares): LoCo's are its stored codes, so its totals are exact; error feedback's fp32
      residuals are rounded to them (within half a code of each 128-value block's largest residual, per rank).
      `save_sent_bytes` counts what this rank sent, `save_full_precision_bytes` what a reduce-scatter of fp32
      states would have.
    LoCo's step count (for its periodic reset) is saved as `loco_steps`. Reductions stage the state; `commit` and
    `discard` settle it once the step's update is applied or dropped (OptimizersContainer calls them).
    """

    def __init__(self, model_parts: list[nn.Module], replicate_group: dist.ProcessGroup | None = None):
        names = {id(p): name for part in model_parts for name, p in part.named_parameters()}
        self.suffix = replica_suffix(replicate_group)
        self.save_sent_bytes = 0
        self.save_full_precision_bytes = 0
        self.entries = []
        for group in _param_groups(model_parts):
            comm = group._reduce_scatter_comm
            if isinstance(comm, CompressedReduceScatter) and comm.compensation is not None:
                self.entries.append((comm, group, [names[id(p.sharded_param)] for p in group.fsdp_params]))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def tensors(self) -> list[torch.Tensor]:
        """The compensation state held now (committed, and staged by this step's reductions)."""
        return [t for comm, _, _ in self.entries for t in comm.compensation.held() if t is not None]

    def state_bytes(self) -> int:
        """Bytes of compensation state this rank holds now."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def commit(self) -> None:
        """The step's gradients will be applied: what their reductions staged becomes the state."""
        for comm, _, _ in self.entries:
            comm.compensation.commit()

    def discard(self) -> None:
        """The step's gradients were dropped: the state stays what it was before the step."""
        for comm, _, _ in self.entries:
            comm.compensation.discard()

    def clear(self) -> None:
        """No compensation owed, as at the first step: what a replica group that healed from a peer starts from."""
        for comm, _, _ in self.entries:
            comm.compensation.discard()
            comm.compensation.residual = None

    def _layout(self, group):
        offset = 0
        for fsdp_param in group.fsdp_params:
            size = fsdp_param.padded_sharded_param_size
            yield fsdp_param, offset, size
            offset += size.numel()

    def _exact(self, comm, group, fqns) -> tuple[str, DTensor]:
        """This rank's state verbatim, as its block of a DTensor over the module's mesh (the data-parallel and any
        tensor-parallel dimension): one block per rank, each flattened."""
        world = group.mesh_info.shard_process_group.size()
        raw = comm.compensation.raw
        if raw is None:
            raw = comm.compensation.raw_template(world, comm.segments, group.device)
        mesh = group.fsdp_params[0].sharded_param.device_mesh
        local = raw.reshape((1,) * mesh.ndim + (-1,))
        shape = (*mesh.shape, local.shape[-1])
        exact = DTensor.from_local(local, mesh, [Shard(dim) for dim in range(mesh.ndim)], shape=shape,
                                   stride=torch.empty(shape, device="meta").stride(), run_check=False)
        return f"{EXACT}compression.{fqns[0]}{self.suffix}", exact

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for comm, group, fqns in self.entries:
            owed = self._owed(comm, group)
            for fqn, (fsdp_param, offset, size) in zip(fqns, self._layout(group)):
                local = owed[offset:offset + size.numel()].view(size)[:fsdp_param.sharded_size[0]]
                state[fqn] = placed_like(local.clone(), fsdp_param.sharded_param)
            key, exact = self._exact(comm, group, fqns)
            state[key] = exact
            if isinstance(comm.compensation, LoCo):
                state["loco_steps"] = torch.tensor(comm.compensation.steps, dtype=torch.int64)
        return state

    def _owed(self, comm, group) -> torch.Tensor:
        """What all ranks owe this rank's shards (fp32, the module's row): every rank's codes for them, decoded and
        summed in rank order."""
        process_group = group.mesh_info.shard_process_group
        world = process_group.size()
        row = sum(size.numel() for _, _, size in self._layout(group))
        codes = comm.compensation.owed_codes(comm.segments)
        if codes is None:
            codes = LoCo.raw_template(world, comm.segments, group.device)
        received = torch.empty_like(codes)
        dist.all_to_all_single(received, codes, group=process_group)
        self.save_sent_bytes += (world - 1) * codes.shape[1]
        self.save_full_precision_bytes += (world - 1) * row * 4
        return decode(received, row, LOCO_ERROR_BITS, segments=comm.segments).sum(dim=0)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for comm, group, fqns in self.entries:
            key, _ = self._exact(comm, group, fqns)
            if key in state_dict:
                exact = state_dict[key]
                exact = exact.to_local() if isinstance(exact, DTensor) else exact
                template = comm.compensation.raw_template(group.mesh_info.shard_process_group.size(),
                                                          comm.segments, group.device)
                comm.compensation.raw = exact.reshape(template.shape).to(template.dtype).clone()
            else:
                self._load_totals(comm, group, fqns, state_dict)
            if isinstance(comm.compensation, LoCo) and "loco_steps" in state_dict:
                comm.compensation.steps = int(state_dict["loco_steps"])

    def _load_totals(self, comm, group, fqns, state_dict: dict[str, Any]) -> None:
        """Each shard's total, held by the shard's own rank (the others owe it nothing)."""
        process_group = group.mesh_info.shard_process_group
        world, rank = process_group.size(), process_group.rank()
        row = sum(size.numel() for _, _, size in self._layout(group))
        residual = torch.zeros(world, row, device=group.device)
        for fqn, (fsdp_param, offset, size) in zip(fqns, self._layout(group)):
            local = state_dict[fqn]
            local = local.to_local() if isinstance(local, DTensor) else local
            residual[rank, offset:offset + size.numel()].view(size)[:local.shape[0]].copy_(local)
        comm.compensation.residual = residual
