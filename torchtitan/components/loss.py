"""Cross-entropy summed over valid tokens; the trainer divides by the global count of valid tokens.

Summing here and normalising once by the count over all data-parallel ranks, accumulation micro-steps and
pipeline micro-batches makes the gradient the same whatever the layout or the accumulation.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32; labels equal to IGNORE_INDEX contribute nothing."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def count_valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()
