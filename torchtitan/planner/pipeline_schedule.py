"""What a pipeline schedule costs beyond its stages' work, from the schedule's own order of actions: its bubble,
the micro-batches each stage holds in flight, and the stage boundaries its sends cross between ranks.

A multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) is a list of
actions per rank that `_PipelineScheduleRuntime` runs in order: forwards, and backwards either whole or split into
an input-gradient pass and a later weight-gradient pass (the zero-bubble schedules fill the warm-up and drain
with the weight passes). Each rank here runs torch's own list, an action starting when the rank is free and what
it needs is done: a forward the previous stage's forward of its micro-batch, a backward (or input-gradient pass)
the next stage's and its own forward, a weight-gradient pass its input-gradient pass. The step's length over the
work of one rank is the bubble. Sends are not on this clock (cost.pipeline_p2p_seconds counts those on the
critical path).

The single-stage schedules (GPipe, 1F1B) run imperatively, with no action list; with equal stages both take
(m + pp - 1) stage-micro-batch passes for m micro-batches (m >= pp), the closed form. The looped multi-stage schedules
(Interleaved1F1B, LoopedBFS) come out of the simulation as (m v + pp - 1) / (m v) with v stages per rank, the
textbook bubble, whatever the passes' shares (tests/unit/test_planner.py); the zero-bubble ones below it.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from torch import nn
from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                    ScheduleGPipe, get_schedule_class)

from torchtitan.distributed.pipeline_parallel import (SPLIT_BACKWARD, V_SHAPED, is_multi_stage,
                                                     stage_ids_for_rank)

Action = Any  # an entry of a schedule's action list (torch's private _Action)



def v_shaped(schedule: str) -> bool:
    return issubclass(get_schedule_class(schedule), V_SHAPED)


def split_backward(schedule: str) -> bool:
    """Whether the schedule runs each backward as an input-gradient pass and a later weight-gradient pass."""
    return issubclass(get_schedule_class(schedule), SPLIT_BACKWARD)


@functools.lru_cache(maxsize=256)
def schedule_order(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> dict[int, tuple[Action, ...]]:
    """torch's action list of every rank for a multi-stage schedule (idle slots left out). The schedule computes
    all ranks' lists when it is built; it is built here for rank 0 over stand-ins for its stages, which carry what
    the schedule reads of them."""
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * stages_per_rank, stage_index=index,
                              is_first=index == 0, is_last=index == pp * stages_per_rank - 1, submod=nn.Identity())
              for index in stage_ids_for_rank(0, pp, pp * stages_per_rank, v_shaped(schedule))]
    order = get_schedule_class(schedule)(stages, microbatches).pipeline_order
    return {rank: tuple(action for action in actions if action is not None) for rank, actions in order.items()}


@functools.lru_cache(maxsize=4096)
def bubble(schedule: str | None, pp: int, stages_per_rank: int, microbatches: int, forward: float,
           backward_input: float, backward_weight: float) -> float:
    """The step's length over one rank's work, for stages of equal work: `forward`, `backward_input` (recomputation
    included) and `backward_weight` are one stage-micro-batch's passes, in any unit."""
    if pp == 1:
        return 1.0
    if schedule is None or not is_multi_stage(schedule):
        return (microbatches + pp - 1) / microbatches
    durations = {FORWARD: forward, BACKWARD_INPUT: backward_input, BACKWARD_WEIGHT: backward_weight,
                 FULL_BACKWARD: backward_input + backward_weight}
    order = schedule_order(schedule, pp, stages_per_rank, microbatches)
    last_stage = pp * stages_per_rank - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)

    def key(part: Action) -> tuple[str, int, int]:
        # A whole backward completes the input gradient the previous stage waits for, as an input pass does.
        kind = "I" if part.computation_type in (BACKWARD_INPUT, FULL_BACKWARD) else part.computation_type.value
        return kind, part.stage_index, part.microbatch_index

    def needs(part: Action) -> list[tuple[str, int, int]]:
        stage, microbatch = part.stage_index, part.microbatch_index
        if part.computation_type == FORWARD:
            return [("F", stage - 1, microbatch)] if stage > 0 else []
        if part.computation_type == BACKWARD_WEIGHT:
            return [("I", stage, microbatch)]
        return [("F", stage, microbatch)] + ([("I", stage + 1, microbatch)] if stage < last_stage else [])

    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                parts = action.sub_actions or (action,)  # DualPipeV runs a forward and a backward as one action
                own = {key(part) for part in parts}
                waits = [need for part in parts for need in needs(part) if need not in own]
                if any(need not in done for need in waits):
                    break
                end = max([clock[rank], *(done[need] for need in waits)]) + sum(
                    durations[part.computation_type] for part in parts)
                done.update(dict.fromkeys(own, end))
                clock[rank], position[rank] = end, position[rank] + 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule}'s action lists wait on each other (pp {pp}, {microbatches} micro-batches)")
    work = microbatches * stages_per_rank * (forward + backward_input + backward_weight)
    return max(clock.values()) / work


@functools.lru_cache(maxsize=1024)
def in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int,
              rebuilt: float = 0.0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The micro-batches whose activations each of `rank`'s stages (in increasing stage order) holds when the rank
    holds the most, and of those, how many have run their input-gradient pass and await their weight pass.

    A stage keeps a micro-batch's activations from its forward to its backward, or, with the backward split, to its
    weight-gradient pass, which reads what the forward saved. Under activation checkpointing the input-gradient
    pass has rebuilt the block's activations, and they too stay until the weight pass: a micro-batch awaiting it
    weighs 1 + `rebuilt` (the rebuilt bytes over the checkpointed ones) when the moment of the most is found. For
    Interleaved1F1B and LoopedBFS the count is their closed form (tests/unit/test_planner.py); GPipe holds every
    micro-batch, 1F1B the pp - rank of its warm-up."""
    if not is_multi_stage(schedule):
        held = microbatches if get_schedule_class(schedule) is ScheduleGPipe else min(microbatches, pp - rank)
        return (held,), (0,)
    stages = stage_ids_for_rank(rank, pp, pp * stages_per_rank, v_shaped(schedule))
    forwarded: dict[int, set[int]] = {stage: set() for stage in stages}
    awaiting: dict[int, set[int]] = {stage: set() for stage in stages}
    most, most_awaiting, most_weight = tuple(0 for _ in stages), tuple(0 for _ in stages), 0.0
    for action in schedule_order(schedule, pp, stages_per_rank, microbatches)[rank]:
        for part in action.sub_actions or (action,):
            stage, microbatch = part.stage_index, part.microbatch_index
            if part.computation_type == FORWARD:
                forwarded[stage].add(microbatch)
            elif part.computation_type == BACKWARD_INPUT:
                awaiting[stage].add(microbatch)
            else:  # a whole backward, or the weight pass
                forwarded[stage].discard(microbatch)
                awaiting[stage].discard(microbatch)
        weight = sum(len(forwarded[stage]) + rebuilt * len(awaiting[stage]) for stage in stages)
        if weight > most_weight:
            most_weight = weight
            most = tuple(len(forwarded[stage]) for stage in stages)
            most_awaiting = tuple(len(awaiting[stage]) for stage in stages)
    return most, most_awaiting


def boundaries_between_ranks(schedule: str | None, pp: int, stages_per_rank: int) -> int:
    """Boundaries between consecutive stages that lie on different ranks: all of them, except the turn of a V
    (ZBVZeroBubble, DualPipeV), whose stages pp - 1 and pp share the last rank."""
    turns = 1 if schedule is not None and pp > 1 and v_shaped(schedule) else 0
    return pp * stages_per_rank - 1 - turns
