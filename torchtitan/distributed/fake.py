"""What a full-scale dry run needs from torch.distributed: one process playing one rank of a large world.

- `init_fake_process_group`: torch's `fake` backend (every collective returns at once) for a world of any size.
- `CollectiveCounter`: every collective the rank issues, by kind and mesh dimension, with the bytes it moves.
- `StepMemoryTracker`: torch's own memory trackers (`FSDPMemTracker`, `MemTracker`) over this rank's model parts,
  made to accept what a pipeline stage does: several roots, several optimizers, one forward per micro-batch.

All of it runs under `FakeTensorMode`: tensors have shapes and dtypes but no storage, so a 405B model's rank fits
in a laptop's memory. See torchtitan/dry_run.py for the run itself and docs/scaling.md for its use.
"""

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.distributed import torch_compat
from torchtitan.nn import attention

# torch's private tools, which only a dry run uses: a torch that lacks one refuses the dry run at start-up
# (torch_compat.require_torch_features) and still imports this module.
FSDPMemTracker = torch_compat.private_base("FSDPMemTracker")
MemTracker = torch_compat.private_base("MemTracker")
TorchDispatchMode = torch_compat.private_base("TorchDispatchMode")

GIB = 2**30


def init_fake_process_group(rank: int, world_size: int) -> None:
    # Looking up the store imports its module, which registers the `fake` backend: only a dry run pays for it.
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=torch_compat.get("FakeStore")())


def host_values(t: torch.Tensor) -> list[float]:
    """`t.tolist()` for a 1-D tensor; a fake tensor (dry run) has no values: it reads as zeros (finite, no stop)."""
    if torch_compat.is_fake(t):
        return [0.0] * t.numel()
    return t.tolist()


# Collectives FSDP, TP, CP and PP issue, by the name this report gives them.
_KIND = {
    "allgather": "all_gather", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "broadcast": "broadcast", "alltoall": "all_to_all",
    "all_to_all": "all_to_all", "shard_dim_alltoall": "all_to_all", "send": "send", "recv": "recv",
    "batch_p2p": "p2p", "gather": "gather", "scatter": "scatter", "reduce": "reduce", "barrier": "barrier",
}


def _kind_of(func: "torch._ops.OpOverload") -> str:
    name = func._schema.name.split("::", 1)[1].strip("_")
    for prefix, kind in _KIND.items():
        if name.startswith(prefix):
            return kind
    return name


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _buffer_bytes(func: "torch._ops.OpOverload", result: Any, args: tuple, kwargs: dict | None) -> int:
    """The larger of what goes in and what comes out, counted by element (torch's `CollectiveOp` counts some ops by
    their input and some by the whole storage a view belongs to): the gathered output of an all-gather, the
    unreduced input of a reduce-scatter, the tensor of an all-reduce, the buffer of an all-to-all."""
    if _kind_of(func) == "p2p":
        return torch_compat.get("fake_collectives").CollectiveOp.get_comm_tensor_size(func, result, args, kwargs)
    return max(_tensor_bytes(result), *(_tensor_bytes(arg) for arg in args))


class CollectiveCounter(TorchDispatchMode):
    """Counts each collective this rank issues, grouped by (kind, mesh dimension): calls and bytes.

    Bytes are those of the buffer the collective works on (`_buffer_bytes`): the gathered output of an all-gather,
    the unreduced input of a reduce-scatter, the tensor of an all-reduce, the buffer of an all-to-all or a send.
    """

    def __init__(self, parallel_dims):
        super().__init__()
        self._dim_of_group = self._group_names(parallel_dims)
        self.records: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})

    @staticmethod
    def _group_names(parallel_dims) -> dict[str, str]:
        """Process-group name -> mesh dimension (the first name of a group that several dimensions share)."""
        names = {}
        for dim in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"):
            mesh = parallel_dims.get_mesh(dim)
            if mesh.size() > 1:
                names.setdefault(mesh.get_group().group_name, dim)
        names.setdefault(dist.group.WORLD.group_name, "world")
        return names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # An op on DTensors reaches this mode before DTensor runs it, and the collectives DTensor then issues for it
        # (redistributions, context parallelism's ring attention) would run with this mode off the stack, uncounted:
        # let DTensor run the op first, as torch's CommDebugMode does, so that they come back here.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        result = func(*args, **(kwargs or {}))
        tracked = torch_compat.get("fake_collectives")
        if func in tracked.collective_ops and func not in tracked.sync_ops:
            group = tracked.CollectiveOp.get_process_group(func, args)
            dim = self._dim_of_group.get(group.group_name, f"group {group.group_name}")
            record = self.records[(_kind_of(func), dim)]
            record["count"] += 1
            record["bytes"] += _buffer_bytes(func, result, args, kwargs)
        return result

    def summary(self) -> list[dict[str, Any]]:
        return [{"kind": kind, "mesh_dim": dim, **record}
                for (kind, dim), record in sorted(self.records.items(), key=lambda item: -item[1]["bytes"])]


@contextlib.contextmanager
def _replaced(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def dry_run_patches(target_device: str, fake_tensors: bool = True) -> contextlib.ExitStack:
    """What a dry run changes in torch and torchao while it runs, each because fake tensors, the fake backend or
    the CPU mesh standing in for the target's cannot do what the original does; the accounting is unchanged (see
    each replacement). On real tensors only the fake backend's part applies."""
    from torch.distributed.tensor import placement_types

    stack = contextlib.ExitStack()
    schedule_base = torch_compat.get("PipelineSchedule")
    if hasattr(schedule_base, "_warmup_p2p"):  # torch 2.13's vote on static shapes; older torch has none
        stack.enter_context(_replaced(schedule_base, "_warmup_p2p", _static_pipeline_warmup))
    if not fake_tensors:
        return stack
    if target_device != "cpu" and torch_compat.lookup("resolve_group") and torch_compat.lookup("group_or_group_name"):
        stack.enter_context(_replaced(placement_types, "shard_dim_alltoall", _shard_dim_alltoall_as_on_gpus))
    propagator = torch_compat.get("ShardingPropagator")
    stack.enter_context(_replaced(propagator, "_propagate_tensor_meta_non_cached",
                                  _separate_propagation(propagator._propagate_tensor_meta_non_cached)))
    stack.enter_context(_replaced(torch.Tensor, "pin_memory", _pinning_without_storage(torch.Tensor.pin_memory)))
    if target_device == "cuda":
        stack.enter_context(_replaced(attention, "_compiled_flex_attention", _flex_attention_as_flash))
    # torch.compile that components call themselves (FlexAttention and its block mask on the GPU path) runs eagerly,
    # as the model does: a compiled kernel would read the storage fake tensors do not have.
    stack.enter_context(torch.compiler.set_stance("force_eager"))
    try:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError:
        return stack
    stack.enter_context(_replaced(WeightWithDynamicFloat8CastTensor, "__tensor_flatten__",
                                  _float8_flatten_without_values))
    return stack


def _shard_dim_alltoall_as_on_gpus(input, gather_dim, shard_dim, mesh, mesh_dim):
    """DTensor moves a shard to another dimension by an all-to-all, except on a CPU mesh (gloo has none), where it
    all-gathers the whole tensor and keeps its chunk; torch's fake kernel of the all-to-all does the same, and its
    chunk is a view that keeps the whole gathered tensor alive: n times the memory (at 405B a column-split
    embedding's output, 256 MiB per micro-batch in flight; a Muon stack n times over). A dry run for GPUs runs on a
    CPU mesh: do what the GPUs' kernel (torch's `_dtensor::shard_dim_alltoall`) does, with the memory it takes: a
    contiguous copy of the input's chunks in rank order, the all-to-all into a buffer of the same size (the fake
    backend has one, and the collective counter sees it), and the received chunks made contiguous along the
    gathered dimension."""
    group = torch_compat.get("resolve_group")((mesh, mesh_dim))
    n = mesh.size(mesh_dim)
    chunked = list(input.shape)
    chunked[shard_dim] //= n
    chunked.insert(shard_dim, n)
    chunks = input.view(chunked).movedim(shard_dim, 0).contiguous()
    received = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_to_all_single(
        chunks, [1] * n, [1] * n, torch_compat.get("group_or_group_name")(group)))
    output = list(input.shape)
    output[shard_dim] //= n
    output[gather_dim] *= n
    return received.movedim(0, gather_dim).contiguous().view(output)


def _separate_propagation(original):
    """DTensor learns an op's output shape by running it on fake tensors of the global shape, in the fake mode
    it finds active. In a dry run that is the run's own mode, where the memory trackers would count those
    global-shape tensors (a full-vocabulary fp32 copy of the logits, say) as this rank's memory. Give the
    propagation a fake mode of its own, which the trackers skip."""
    propagation_mode = torch_compat.get("FakeTensorMode")()
    unset_fake_temporarily = torch_compat.get("unset_fake_temporarily")

    def propagate(self, op_schema):
        with unset_fake_temporarily(), propagation_mode:
            return original(self, op_schema)
    return propagate


def _static_pipeline_warmup(self, stages, has_backward, p2p_done) -> None:
    """At its first step a pipeline schedule lets its stages vote, over point-to-point messages, whether all of
    them know their shapes (static) or must exchange them (dynamic). The fake backend delivers no message, so the
    vote cannot be read; a dry run gives every stage its shapes (`static_stage_shapes`), which is the static case."""
    for stage in stages:
        stage._inference_mode = torch_compat.get("PipelineInferenceMode").STATIC


def _flex_attention_as_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask,
                             enable_gqa: bool) -> torch.Tensor:
    """On GPUs, attention over keys and values gathered by context parallelism runs FlexAttention
    (model.block_causal_attention), which has no backward on the CPU, where a dry run's fake tensors live. In memory
    it is flash attention: it saves the query, the keys and values it attended to, the output and the logsumexp (and
    a per-row maximum, as small) and returns the output. The CPU's flash kernel, grouped heads as they are, stands in
    for it; fake tensors carry no values for the mask to change."""
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, enable_gqa=enable_gqa)


def _pinning_without_storage(original):
    """FSDP's CPU offload pins the host copies of the shards; a fake tensor has no memory to pin (torch raises
    "NYI: aten._pin_memory"). The accounting is the same pinned or not: pinning returns the tensor itself."""
    def pin_memory(self, *args, **kwargs):
        return self if torch_compat.is_fake(self) else original(self, *args, **kwargs)
    return pin_memory


def _float8_flatten_without_values(self):
    """torchao's float8 all-gather weight tests its precomputed scale for truth (`if scale:`), which reads the
    value; a fake scale has none. Test it for presence, as torchao's own all-gather hook does."""
    tensors = ["_tensor"] + (["_precomputed_scale"] if self._precomputed_scale is not None else [])
    return tensors, {"mm_config": self._linear_mm_config, "dtype": self._dtype}


class _RootsPerMicroBatch:
    """A pipeline stage's module is entered once per micro-batch, from the schedule rather than from a parent
    module; torch's trackers take a second root-level forward for the next iteration and refuse it. Forget the
    root's per-module statistics at each entry (the tracker's global peak, which is what the dry run reads, is kept).

    It also keeps a second peak, of the device alone: without the categories that live in host memory (FSDP's CPU
    offload keeps the shards of parameters and gradients and the optimizer state there). A dry run's tensors all
    sit on one device, so the tracker's per-device peak cannot tell them apart; the categories can.

    And the peak of each phase of the step (PHASES): the optimizer step while an optimizer steps, the backward while
    autograd's engine runs, the forward while a module's forward runs; between them the phase is the last one
    entered (the loss belongs to the forward, gradient clipping to the backward, and what the step starts with to
    the previous step's optimizer step).
    """

    _roots: set[nn.Module]
    _host_categories: frozenset[str] = frozenset()
    _device_peak: int = 0
    _device_peak_snap: dict[str, int] | None = None
    _phase: str = "optimizer step"  # what the previous step's optimizer step left, until the first forward
    _phase_peaks: dict[str, tuple[int, dict[str, int]]]

    def _forget_root(self, module: nn.Module) -> None:
        if module in self._roots and not self._mod_tracker.is_bw:
            self.memory_tracking.pop(module, None)

    def _current_phase(self) -> str:
        if self._in_opt:
            self._phase = "optimizer step"
        elif self._mod_tracker.is_bw:
            self._phase = "backward"
        elif len(self._mod_tracker.parents) > 1:  # a module's forward is running ("Global" is always there)
            self._phase = "forward"
        return self._phase

    def _by_category(self, leave_out: frozenset[str] = frozenset()) -> dict[str, int]:
        snap: dict[str, int] = defaultdict(int)
        for device_snap in self._curr_mem_snap.values():
            for key, value in device_snap.items():
                raw = getattr(key, "value", key)
                name = _CATEGORY.get(raw, str(raw))
                if raw != "Total" and name not in leave_out:
                    snap[name] += value
        return dict(snap)

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        phase = self._current_phase()
        total = sum(device_snap.get("Total", 0) for device_snap in self._curr_mem_snap.values())
        if total > self._phase_peaks.get(phase, (0, {}))[0]:
            self._phase_peaks[phase] = (total, self._by_category())
        if not self._host_categories:
            return
        snap = self._by_category(self._host_categories)
        if sum(snap.values()) > self._device_peak:
            self._device_peak, self._device_peak_snap = sum(snap.values()), snap


class _FSDPStageMemTracker(_RootsPerMicroBatch, FSDPMemTracker):
    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        super().__init__(parts[0])
        # Several roots (interleaved schedules hold several stages): iterated only for their modules and buffers.
        self._root_mod = nn.ModuleList(parts)
        self._roots = set(parts)
        self._optimizers = optimizers

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            self._forget_root(fsdp_mod)
            return inner(*args, **kwargs)
        return pre_forward

    def _fsdp_states(self) -> list[tuple[nn.Module, Any]]:
        """Each FSDP state of the parts that holds parameters, once, with the first module it covers."""
        states = {}
        for module in self._root_mod.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                if state._fsdp_param_group is not None:
                    states.setdefault(id(state), (module, state))
        return list(states.values())

    @staticmethod
    def _register_forward_hooks(state, pre_forward, post_forward, always_call: bool) -> None:
        """Forward hooks as FSDP registers its own. torch's tracker registers them on every FSDP module, which
        splits a state over several modules (fully_shard of a list: the final norm and the output layer) into one
        forward, hence one post-backward reduction, per module: the first of them then runs before the norm's
        gradient exists, which FSDP reduces again later (one reduce-scatter too many), and which a compressed
        reduce-scatter, whose layout is the whole group's, refuses. A group keeps its group hooks: the pre-forward
        before its first module, the post-forward after its last."""
        modules = state._modules
        if len(modules) == 1:
            state._pre_forward_hook_handle = modules[0].register_forward_pre_hook(pre_forward, prepend=True,
                                                                                with_kwargs=True)
            state._post_forward_hook_handle = modules[0].register_forward_hook(post_forward, prepend=False,
                                                                               always_call=always_call)
        else:
            register_group_hooks = torch_compat.get("register_group_forward_hooks")
            state._pre_forward_hook_handle = state._post_forward_hook_handle = register_group_hooks(
                modules, pre_forward, post_forward, state._modules_to_run_forward, state._cast_output_dtype)

    def _instrument_fsdp_module(self) -> None:
        states = self._fsdp_states()
        for _, state in states:
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
        for module, state in states:
            group = state._fsdp_param_group
            self._instrument_fsdp_sharded_params_grads(group)
            self._register_forward_hooks(state, self._fsdp_state_pre_forward(module, state._pre_forward),
                                         self._fsdp_state_post_forward(module, state._post_forward), always_call=True)
            self._fsdp_mod_to_saved_methods[module] = torch_compat.get("FSDPSavedMethods")(group.pre_backward,
                                                                                          group.post_backward)
            group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
            group.post_backward = self._fsdp_param_group_post_backward(module, group.post_backward)
        for buffer in self._root_mod.buffers():
            self._update_and_maybe_create_winfos(buffer, torch_compat.get("FSDPRefType").BUFFER)

    def _deregister_module_and_optimizer_hooks(self) -> None:
        for module, saved in self._fsdp_mod_to_saved_methods.items():
            state = module._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            self._register_forward_hooks(state, state._pre_forward, state._post_forward, always_call=False)
            state._fsdp_param_group.pre_backward = saved.pre_backward
            state._fsdp_param_group.post_backward = saved.post_backward
        self._fsdp_mod_to_saved_methods.clear()
        for handle in self._optimizer_hook_handles or ():
            handle.remove()
        self._optimizer_hook_handles = None

    def _instrument_optimizer(self) -> None:
        handles = []
        for optimizer in self._optimizers:
            self._optm = optimizer
            super()._instrument_optimizer()
            handles.extend(self._optimizer_hook_handles)
        self._optimizer_hook_handles = tuple(handles)


class _PlainStageMemTracker(_RootsPerMicroBatch, MemTracker):
    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        super().__init__()
        self._roots = set(parts)
        self.track_external(*parts, *optimizers)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        self._forget_root(module)
        super()._pre_fw_hook(module, inputs)


# Tracker categories -> the report's categories.
_CATEGORY = {
    "Sharded Param": "parameters", "Unsharded Param": "parameters_unsharded", "Parameter": "parameters",
    "Buffer": "buffers", "Sharded Grad": "gradients", "Unsharded Grad": "gradients_unsharded",
    "Gradient": "gradients", "Activation": "activations", "Temp": "temporaries", "All Gather": "all_gather_buffers",
    "Reduce Scatter": "reduce_scatter_buffers", "Optstate": "optimizer_state", "OptState": "optimizer_state", "Inputs": "inputs",
    "Other": "other",
}


# The phases of a training step whose peaks a dry run reports.
PHASES = ("forward", "backward", "optimizer step")


class StepMemoryTracker:
    """The peak memory of this rank's model parts and optimizers over what runs inside the `with` block, by
    category, from `FSDPMemTracker` when the parts are FSDP modules, else from the generic `MemTracker`;
    `host_categories` (report categories held in host memory) also give the device's own peak."""

    def __init__(self, parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 host_categories: tuple[str, ...] = (), state: list[torch.Tensor] = ()):
        """`state`: tensors held between steps outside the optimizers' state (gradient compression's compensation
        state), counted as optimizer state."""
        tracker_class = _FSDPStageMemTracker if isinstance(parts[0], FSDPModule) else _PlainStageMemTracker
        self._tracker = tracker_class(parts, optimizers)
        self._tracker._host_categories = frozenset(host_categories)
        self._tracker._phase_peaks = {}
        self._state = list(state)

    def __enter__(self) -> "StepMemoryTracker":
        self._tracker.__enter__()
        for tensor in self._state:
            self._tracker._update_and_maybe_create_winfos(tensor, self._tracker._ref_class.OPT)
        self._state = []  # the tracker holds weak references only: the step may free them
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)

    def peak_by_category(self) -> dict[str, int]:
        """Bytes per category at the moment the total peaked (all devices of this rank together)."""
        by_category: dict[str, int] = defaultdict(int)
        for device_snapshot in self._tracker.get_tracker_snapshot("peak").values():
            for key, value in device_snapshot.items():
                name = getattr(key, "value", key)
                if name == "Total":
                    continue
                by_category[_CATEGORY.get(name, str(name))] += value
        return dict(by_category)

    def peak_by_phase(self) -> dict[str, dict[str, int]]:
        """Per phase of the step (PHASES, in order), bytes per category at the moment that phase's total peaked."""
        return {phase: dict(self._tracker._phase_peaks[phase][1]) for phase in PHASES
                if phase in self._tracker._phase_peaks}

    def device_peak_by_category(self) -> dict[str, int]:
        """Bytes per category, host categories left out, at the moment their sum peaked: the device's own peak
        (the whole peak_by_category when no category lives in host memory)."""
        if not self._tracker._host_categories:
            return self.peak_by_category()
        return dict(self._tracker._device_peak_snap or {})
