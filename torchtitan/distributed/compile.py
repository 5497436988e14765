"""torch.compile of each transformer block in place (names and state-dict keys are unchanged), and of the loss.

Blocks are identical in structure, so one compiled graph serves them all; compiling per block keeps compile time
flat in depth and lets FSDP hooks run between blocks.
"""

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.tools.logging import warn_once


def apply_compile(model: nn.Module, backend: str, fullgraph: bool = True) -> None:
    """`fullgraph=False` where the blocks hold code that must not be traced: rotated tensor parallelism's rotations
    run under torch.compiler.disable, and each breaks the block's graph."""
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)


def compile_loss(loss_fn: Callable, backend: str, loss_parallel: bool) -> Callable:
    """The loss compiled, except under loss parallelism: loss_parallel() computes the cross-entropy of
    vocabulary-sharded logits through DTensor op handlers, and compiled, that gave wrong losses (13.4 for 8.06 on
    TP 2, torch 2.13). The sharded eager loss already avoids materialising the whole logits."""
    if loss_parallel:
        warn_once("compile.components: the loss runs eagerly under loss parallelism (compiled, it gives wrong "
                  "values); the blocks are still compiled")
        return loss_fn
    return torch.compile(loss_fn, backend=backend)
