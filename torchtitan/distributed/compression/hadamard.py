"""The Walsh-Hadamard rotation (HadaCore's transform) of fixed-size blocks, applied before low-bit quantization.

A normalised Hadamard matrix is orthogonal and its own inverse, and it spreads each block's energy over all its
entries: one outlier no longer sets the scale of a whole block, so the other values keep more of their bits. It is
linear, so a sum of rotated blocks can be rotated back once, after the sum.

The rotation is one matmul by the (block x block) matrix, as HadaCore does on tensor cores: for 128-value blocks a
BLAS matmul is several times faster on a CPU than the log2(128)-stage butterfly written with tensor ops.
"""

import functools
import math

import torch


@functools.lru_cache(maxsize=8)
def hadamard_matrix(size: int, device: torch.device) -> torch.Tensor:
    """The normalised (size x size) Walsh-Hadamard matrix, by Sylvester's construction; symmetric and orthogonal."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard blocks must be a power of two long, not {size}")
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return (matrix / math.sqrt(size)).to(device)


def hadamard_rotate(blocks: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension (a power of two) by the normalised Walsh-Hadamard matrix; applying it twice is the
    identity (up to rounding)."""
    return blocks @ hadamard_matrix(blocks.shape[-1], blocks.device)
