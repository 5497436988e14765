"""Attention's time at its own speed: the (query, key) pairs a mask leaves, and what the attention kernel reaches
by sequence length and head dimension, not the GEMM efficiency fitted on 8k rows (where attention is a tenth of
the work; at 256k it is most of it).

FLOPs, in the convention of FlashAttention's benchmarks: forward 4 x pairs x head_dim per head (Q K^T and P V),
backward 2.5 x that (it recomputes Q K^T: five matmuls to the forward's two). Pairs: a causal mask keeps s^2 / 2 of
the s x s, a block-causal mask (packed documents) the sum over documents of len^2 / 2 = s x E[len^2] / E[len] / 2,
so documents enter through one number, E[len^2] / E[len] (`document_length`; for documents of one length, that
length).

Speed: FlashAttention-2 (torch's SDPA flash kernel, which the causal path runs) on one H100 SXM, bf16, from the
FlashAttention-3 paper (Shah et al. 2024, arXiv:2407.08608, Figures 5 and 6: batch x seqlen = 16k, 16 x 128 or 32 x
64 heads), as a fraction of the H100's 989 TFLOP/s peak, applied to the peak of the GPU planned. The paper gives
the backward without mask only; the causal backward takes the forward's causal/no-mask ratio at the same length.
Beyond 16k the curves are flat (the kernel's tiles are full). Head dimensions between 64 and 128 interpolate, others
take the nearest. Block-causal runs FlexAttention with a block mask (torchtitan/models/llama3/model.py), at 90% of
FlashAttention-2 forward and 85% backward (PyTorch's FlexAttention announcement, pytorch.org/blog/flexattention,
2024-08, H100) at the documents' length. `scripts/calibrate_gpu.py` measures all of it on the GPU at hand
(`plan.py --calibrate FILE`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

FLASH_PEAK_FLOPS = 989e12
FLASH_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
# TFLOP/s of FlashAttention-2 on H100 SXM (FlashAttention-3 paper, Figures 5 and 6), by head dim and mask.
FLASH_FORWARD = {
    (64, "full"): (282, 306, 318, 321, 322, 324),
    (128, "full"): (309, 350, 362, 368, 370, 370),
    (128, "causal"): (191, 260, 298, 319, 333, 335),
}
FLASH_BACKWARD_FULL = {128: (214, 260, 291, 310, 318, 322)}
FLEX_FRACTION = {"forward": 0.90, "backward": 0.85}
BACKWARD_FLOPS_RATIO = 2.5


@dataclass(frozen=True)
class AttentionRates:
    """Attention kernel speed in FLOP/s by (pass, mask) as a curve over sequence lengths: the published defaults
    scaled to a GPU's peak, or what scripts/calibrate_gpu.py measured on one."""

    seq_lens: tuple[int, ...]
    curves: tuple[tuple[str, str, tuple[float, ...]], ...]
    """(forward or backward, causal or full, FLOP/s at each of seq_lens)."""
    source: str

    def rate(self, direction: str, mask: str, seq_len: float) -> float:
        """FLOP/s at `seq_len` keys: linear between measured lengths, flat beyond them."""
        curve = next(values for d, m, values in self.curves if (d, m) == (direction, mask))
        lens = self.seq_lens
        if seq_len <= lens[0]:
            return curve[0]
        if seq_len >= lens[-1]:
            return curve[-1]
        i = bisect.bisect_right(lens, seq_len)
        w = (seq_len - lens[i - 1]) / (lens[i] - lens[i - 1])
        return curve[i - 1] + w * (curve[i] - curve[i - 1])


def published_rates(bf16_flops: float, head_dim: int) -> AttentionRates:
    """FlashAttention-2's published fractions of the H100's peak, at `head_dim`, on a GPU of `bf16_flops`."""
    h = min(128, max(64, head_dim))
    w = (h - 64) / 64
    full_128 = FLASH_FORWARD[(128, "full")]
    # At head dim 64 only the forward without mask is published: the other curves take its ratio to 128's.
    scale = [w + (1 - w) * a / b for a, b in zip(FLASH_FORWARD[(64, "full")], full_128)]
    causal_ratio = [c / f for c, f in zip(FLASH_FORWARD[(128, "causal")], full_128)]
    to_flops = bf16_flops / FLASH_PEAK_FLOPS * 1e12
    curves = (
        ("forward", "full", tuple(f * s * to_flops for f, s in zip(full_128, scale))),
        ("forward", "causal", tuple(f * s * to_flops for f, s in zip(FLASH_FORWARD[(128, "causal")], scale))),
        ("backward", "full", tuple(f * s * to_flops for f, s in zip(FLASH_BACKWARD_FULL[128], scale))),
        ("backward", "causal", tuple(f * s * r * to_flops
                                     for f, s, r in zip(FLASH_BACKWARD_FULL[128], scale, causal_ratio))),
    )
    return AttentionRates(seq_lens=FLASH_SEQ_LENS, curves=curves,
                          source="FlashAttention-2 on H100 SXM (arXiv:2407.08608), scaled to the GPU's peak")


@dataclass(frozen=True)
class AttentionCall:
    """One kernel call shape repeated `count` times per layer and sequence: queries, keys, mask."""

    queries: float
    keys: float
    mask: str
    """causal (on the diagonal block), full (a block every query sees whole) or block_causal (documents)."""
    count: int = 1

    def pairs(self, document_length: float) -> float:
        if self.mask == "causal":
            return self.queries * self.keys / 2
        if self.mask == "block_causal":
            return self.queries * min(document_length, self.keys) / 2
        return self.queries * self.keys


def attention_calls(seq_len: int, cp: int, document_length: float) -> list[AttentionCall]:
    """The kernel calls of one layer's attention over one sequence, on one context-parallel rank.

    Causal without CP: one call. Causal under CP (torch's ring attention, head-tail balanced: each rank holds chunks
    i and 2cp-1-i of 2cp): its diagonal block, causal over its s/cp queries, and cp - 1 blocks without mask, each
    half the queries against all of a peer's keys or all the queries against half of them: s^2 / (2 cp) pairs per
    rank, the balanced share. Block-causal (any CP): the rank's queries against all keys under the document mask,
    the visible pairs balanced by the chunk assignment (context_parallel.py)."""
    local = seq_len / cp
    if document_length:
        return [AttentionCall(local, seq_len, "block_causal")]
    if cp == 1:
        return [AttentionCall(seq_len, seq_len, "causal")]
    return [AttentionCall(local, local, "causal"), AttentionCall(local, local / 2, "full", cp - 1)]


def attention_seconds(calls: list[AttentionCall], flops_per_pair: float, rates: AttentionRates,
                      document_length: float) -> tuple[float, float]:
    """(forward, backward) seconds of the calls; `flops_per_pair`: 4 x head_dim x heads on the rank."""
    forward = backward = 0.0
    for call in calls:
        flops = call.count * call.pairs(document_length) * flops_per_pair
        if call.mask == "block_causal":
            length = min(document_length, call.keys)
            forward += flops / (rates.rate("forward", "causal", length) * FLEX_FRACTION["forward"])
            backward += BACKWARD_FLOPS_RATIO * flops / (rates.rate("backward", "causal", length)
                                                        * FLEX_FRACTION["backward"])
        else:
            forward += flops / rates.rate("forward", call.mask, call.keys)
            backward += BACKWARD_FLOPS_RATIO * flops / rates.rate("backward", call.mask, call.keys)
    return forward, backward
