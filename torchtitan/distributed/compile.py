"""torch.compile of each transformer block in place (names and state-dict keys are unchanged).

Blocks are identical in structure, so one compiled graph serves them all; compiling per block keeps compile time
flat in depth and lets FSDP hooks run between blocks.
"""

from torch import nn


def apply_compile(model: nn.Module, backend: str) -> None:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
