"""Splitting the Llama model into pipeline stages (distributed/pipeline_parallel.py places them on the ranks).

The model runs as a chain of units: `tok_embeddings`, the blocks `layers.0` ... `layers.{n-1}`, and the head
(`norm` + `output`, never separated). A stage keeps a contiguous run of units; its module is a copy of the meta
model with every other unit removed, so parameter names (global block indices included) match the whole model's.

Default split: the embedding and the head each count as one block's worth of work, and the n + 2 units are
shared as evenly as possible. When n + 2 divides by the number of stages, every stage gets the same share, so the
first and last stages hold one block fewer than the others (e.g. 6 blocks on 2 stages: embedding + 3 blocks,
3 blocks + head). Otherwise the larger shares go to the first and last stages, then to the second, third, ...
stage, which gives every stage at least one block whenever there are at least as many blocks as stages.

`pipeline_parallel_split_points` (names of blocks that start a new stage) or `pipeline_parallel_layers_per_stage`
(units per stage, the last stage taking what is left) replace the default.
"""

import copy
import math
from collections.abc import Sequence

from torch import nn

from torchtitan.distributed.pipeline_parallel import LAYERS_PER_STAGE_OPTION, SPLIT_POINTS_OPTION
from torchtitan.errors import UserError

EMBEDDING = "tok_embeddings"
HEAD = ("norm", "output")


def stage_units(n_layers: int) -> list[list[str]]:
    """The model's units in forward order, each as the module names it consists of."""
    return [[EMBEDDING], *([f"layers.{i}"] for i in range(n_layers)), list(HEAD)]


def requested_stage_count(n_layers: int, default_count: int, split_points: Sequence[str],
                          layers_per_stage: int | None) -> int:
    """How many stages the split options ask for: split points + 1, the units divided by layers per stage
    (rounded up), or `default_count` when neither option is set."""
    if split_points and layers_per_stage is not None:
        raise UserError(f"options {SPLIT_POINTS_OPTION} ({','.join(split_points)}) and {LAYERS_PER_STAGE_OPTION} "
                        f"({layers_per_stage}) both define the stages; set only one of them")
    if split_points:
        return len(split_points) + 1
    if layers_per_stage is not None:
        if layers_per_stage < 1:
            raise UserError(f"option {LAYERS_PER_STAGE_OPTION}: {layers_per_stage} must be at least 1")
        return math.ceil((n_layers + 2) / layers_per_stage)
    return default_count


def split_into_stages(model: nn.Module, num_stages: int, *, split_points: Sequence[str] = (),
                      layers_per_stage: int | None = None) -> list[list[str]]:
    """The module names each of `num_stages` stages keeps, in stage order (see the module docstring)."""
    n_layers = len(model.layers)
    expected = requested_stage_count(n_layers, num_stages, split_points, layers_per_stage)
    if expected != num_stages:
        option, value = ((SPLIT_POINTS_OPTION, ",".join(split_points)) if split_points
                         else (LAYERS_PER_STAGE_OPTION, layers_per_stage))
        raise UserError(f"option {option}: {value} makes {expected} stages, but the pipeline has {num_stages}")
    units = stage_units(n_layers)
    if split_points:
        starts = _split_point_positions(split_points, n_layers)
    elif layers_per_stage is not None:
        starts = list(range(layers_per_stage, len(units), layers_per_stage))
    else:
        starts = _even_split_positions(n_layers, num_stages)
    bounds = [0, *starts, len(units)]
    return [[name for unit in units[begin:end] for name in unit] for begin, end in zip(bounds, bounds[1:])]


def _split_point_positions(split_points: Sequence[str], n_layers: int) -> list[int]:
    """Unit index at which each split point starts a stage (block i is unit i + 1)."""
    valid = f"layers.0 ... layers.{n_layers - 1}, in increasing order"
    positions = []
    for point in split_points:
        prefix, _, index = point.partition(".")
        if prefix != "layers" or not index.isdigit() or int(index) >= n_layers:
            raise UserError(f"option {SPLIT_POINTS_OPTION}: {point!r} names no transformer block of this "
                            f"{n_layers}-block model; valid: {valid}")
        if positions and int(index) + 1 <= positions[-1]:
            raise UserError(f"option {SPLIT_POINTS_OPTION}: {','.join(split_points)} is not in increasing order "
                            f"(or repeats a block); valid: {valid}")
        positions.append(int(index) + 1)
    return positions


def _even_split_positions(n_layers: int, num_stages: int) -> list[int]:
    if n_layers < num_stages:
        raise UserError(f"option parallelism.pipeline_parallel_degree: {num_stages} pipeline stages (degree x stages "
                        f"per rank of the schedule) need at least {num_stages} transformer blocks, but the model has "
                        f"{n_layers}; use fewer stages (a smaller degree, or a single-stage schedule such as 1F1B), "
                        f"a model with more blocks, or set {SPLIT_POINTS_OPTION}")
    share, larger_shares = divmod(n_layers + 2, num_stages)
    edges_first = [0, num_stages - 1, *range(1, num_stages - 1)] if num_stages > 1 else [0]
    shares = [share] * num_stages
    for stage in edges_first[:larger_shares]:
        shares[stage] += 1
    return [sum(shares[:stage]) for stage in range(1, num_stages)]


def build_stage_module(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A copy of the (meta) model keeping only the modules in `names`; the absent embedding, norm and output
    become None, which the model's forward reads as "hidden states in" / "hidden states out"."""
    known = {name for unit in stage_units(len(model.layers)) for name in unit}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(f"not modules of this model: {unknown}")
    stage = copy.deepcopy(model)
    for index in list(stage.layers):
        if f"layers.{index}" not in names:
            del stage.layers[index]
    for name in (EMBEDDING, *HEAD):
        if name not in names:
            setattr(stage, name, None)
    return stage
