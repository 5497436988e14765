"""Where a training step's time goes, from the events of a `torch.profiler` run on the CPU.

Every profiled op's self time (its time minus its children's) goes to one category, by the op or by the
labelled region it runs in (the trainer labels its regions with `record_function`, torch labels the optimizer's
step); the time of the profiled steps that no op covers is the Python and dispatch work between ops. The shares
add up to the profiled wall time. Inside compiled code the fused kernels are one event each ("compiled kernels"),
while the matmuls and attention that inductor leaves to aten keep their own names.
"""

from __future__ import annotations

from collections.abc import Iterable

CATEGORIES = ("matmul", "attention", "compiled kernels", "norms, elementwise, loss", "optimizer",
              "gradient clipping", "communication and host syncs", "data", "logging and metrics",
              "Python and dispatch between ops")

# Regions labelled with record_function (the trainer's and torch's), checked from the innermost outwards.
_REGIONS = (("Optimizer.step", "optimizer"), ("Optimizer.zero_grad", "optimizer"),
            ("clip_grad_norm", "gradient clipping"), ("step_summary", "communication and host syncs"),
            ("data", "data"), ("log_step", "logging and metrics"))
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
               "aten::_mkldnn", "mkldnn::")
_COMMUNICATION_OPS = ("c10d::", "gloo:", "nccl:", "aten::_local_scalar_dense", "aten::item", "record_param_comms")
_COMPILED = ("CompiledFxGraph", "Torch-Compiled Region", "CompiledFunction", "inductor")


def _op_category(name: str) -> str:
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name.startswith(_MATMUL_OPS):
        return "matmul"
    if name.startswith(_COMMUNICATION_OPS):
        return "communication and host syncs"
    if any(marker in name for marker in _COMPILED):
        return "compiled kernels"
    return "norms, elementwise, loss"


def categorize(event) -> str:
    """The category of one profiler event's self time."""
    parent = event
    while parent is not None:
        for prefix, category in _REGIONS:
            if parent.name.startswith(prefix):
                return category
        parent = parent.cpu_parent
    return _op_category(event.name)


def breakdown(events: Iterable, wall_s: float) -> dict[str, float]:
    """Seconds per category over profiled steps that took `wall_s` in all."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        if event.device_type.name != "CPU" or event.name.startswith("ProfilerStep"):
            continue
        seconds[categorize(event)] += event.self_cpu_time_total / 1e6
    seconds["Python and dispatch between ops"] = max(0.0, wall_s - sum(seconds.values()))
    return seconds


def format_breakdown(seconds: dict[str, float], steps: int) -> str:
    total = sum(seconds.values())
    lines = [f"{'category':<34} {'ms/step':>9} {'share':>7}"]
    lines += [f"{name:<34} {1e3 * value / steps:9.1f} {100 * value / total:6.1f}%"
              for name, value in seconds.items() if value > 0]
    lines.append(f"{'total':<34} {1e3 * total / steps:9.1f}")
    return "\n".join(lines)
