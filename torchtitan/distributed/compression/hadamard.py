"""The Walsh-Hadamard rotation (HadaCore's transform) of fixed-size blocks, applied before low-bit quantization.

A normalised Hadamard matrix is orthogonal and its own inverse, and it spreads each block's energy over all its
entries: one outlier no longer sets the scale of a whole block, so the other values keep more of their bits. It is
linear, so a sum of rotated blocks can be rotated back once, after the sum.
"""

import math

import torch


def hadamard_rotate(blocks: torch.Tensor) -> torch.Tensor:
    """Rotate the last dimension (a power of two) by the normalised Walsh-Hadamard matrix; applying it twice is the
    identity (up to rounding)."""
    size = blocks.shape[-1]
    if size & (size - 1):
        raise ValueError(f"Hadamard blocks must be a power of two long, not {size}")
    lead = blocks.shape[:-1]
    x = blocks.reshape(-1, size)
    half = 1
    # The fast transform: log2(size) butterfly stages, O(size log size) per block instead of a matmul's size^2.
    while half < size:
        pairs = x.view(-1, size // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).view(-1, size)
        half *= 2
    return (x / math.sqrt(size)).view(*lead, size)
