"""The low-bit wire format shared by LoCo and QSDP: blockwise symmetric integer codes with one scale per block.

Each block of `BLOCK` values is sent as `bits`-bit signed codes (two 4-bit codes per byte) and one bfloat16 scale
(the block's absolute maximum over the largest code), concatenated into one uint8 payload, so that a collective
moves one tensor. A row holds several tensors (FSDP's flat buffers concatenate a module's parameters): each segment
starts a block of its own, so that a small tensor (a norm's gradient) never shares a scale with a large one.

Rounding is to nearest (error feedback then carries the error) or stochastic (unbiased, as QSDP's convergence proof
needs). The stochastic draw is a hash, on the device, of each value's position and of a sample of the values being
rounded: the same weights quantize the same way in forward and in the backward re-gather, the draw changes whenever
the weights do, the host never waits for the device, and there is no generator state to checkpoint.
"""

import functools

import torch

from torchtitan.distributed.compression.hadamard import hadamard_rotate

# 128 values per scale: the bfloat16 scale costs 1.6% of the fp32 bytes; 4-bit codes then cost 12.5% + 1.6%.
BLOCK = 128
VALID_BITS = (4, 8)


def padded_length(segments: list[int]) -> int:
    return sum(-(-n // BLOCK) * BLOCK for n in segments)


def payload_bytes(segments: list[int], bits: int) -> int:
    """Bytes of the payload that carries a row made of `segments` (lengths)."""
    padded = padded_length(segments)
    return padded * bits // 8 + 2 * (padded // BLOCK)


@functools.lru_cache(maxsize=256)
def _positions(segments: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where each value of a row goes in the block-aligned row (one tensor per FSDP module, made once)."""
    starts, offset = [], 0
    for n in segments:
        starts.append(torch.arange(offset, offset + n, device=device))
        offset += -(-n // BLOCK) * BLOCK
    return torch.cat(starts)


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' hash-prospector "lowbias32" structure, with multipliers below 2^31) of int64
    tensors holding values in [0, 2^32): every product stays below 2^63, so no signed overflow, on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _add_content_seeded_uniform(x: torch.Tensor) -> None:
    """Add a uniform draw in [0, 1) to every value of the contiguous float32 `x`, in place, from a hash of each
    value's position and a seed made of (a sample of) the values themselves.

    Everything stays on the device: the seed is a device tensor, never read by the host (an `int()` of it would
    synchronise FSDP's communication stream with the host every encode), and no generator is built. The draws are
    24-bit, on the grid of multiples of 2^-24. Antithetic pairs halve the hashing: the first half of the values gets
    draws u, the second half (1 - 2^-24) - u, on the same grid and as uniform. Every value's rounding stays unbiased
    with the same variance; a value and its partner, half the buffer away, round in opposite directions more often
    than independent ones would, which can only lower the error of a sum.
    """
    flat = x.view(-1)
    bits = flat.view(torch.int32)
    seed = _hash32((bits[::4099].to(torch.int64).sum() + bits.numel()) & _MASK32)
    half = (flat.numel() + 1) // 2
    positions = torch.arange(half, dtype=torch.int64, device=x.device)
    draws = (_hash32(positions ^ seed) >> 8).float().mul_(2.0 ** -24)
    flat[half:].add_(torch.rsub(draws[:flat.numel() - half], 1.0 - 2.0 ** -24))
    flat[:half].add_(draws)


def _bfloat16_at_least(scales: torch.Tensor) -> torch.Tensor:
    """The non-negative float32 `scales` rounded up to bfloat16. Rounded to nearest, about half of the blocks' scales
    come out below amax / qmax (by up to bfloat16's half ulp, 2^-9): their largest value then lies beyond the
    largest code and is clamped, which biases stochastic rounding (QSDP's proof needs it unbiased) and clips the
    value. Up is the next bfloat16 bit pattern (the scales are non-negative)."""
    rounded = scales.to(torch.bfloat16)
    return torch.where(rounded.float() < scales, (rounded.view(torch.int16) + 1).view(torch.bfloat16), rounded)


def encode(values: torch.Tensor, bits: int, stochastic: bool = False, rotate: bool = False,
           segments: list[int] | None = None) -> torch.Tensor:
    """Rows of `values` (rows, n), each the concatenation of `segments` (default: one), -> uint8 payload rows
    (rows, payload_bytes(segments, bits))."""
    return _quantize(values, bits, stochastic, rotate, segments, restore=False)[0]


def encode_and_restore(values: torch.Tensor, bits: int, stochastic: bool = False, rotate: bool = False,
                       segments: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode`, and the float32 rows (rows, n) that `decode` makes of its payload, computed from the codes before
    they are packed (the sender's view of what it sent, for error feedback: no unpacking)."""
    return _quantize(values, bits, stochastic, rotate, segments, restore=True)


def _quantize(values: torch.Tensor, bits: int, stochastic: bool, rotate: bool, segments: list[int] | None,
              restore: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    # The codes are those of the float32 values whatever the input's dtype: a block's largest magnitude is exact in
    # any float dtype, and dividing bfloat16 blocks by the float32 scales computes in float32. Rounding works in
    # place on the quotient, which is a new tensor.
    rows, n = values.shape
    segments = segments or [n]
    padded = padded_length(segments)
    if padded == n:
        x = values if values.is_contiguous() else values.contiguous()
    else:
        x = torch.zeros(rows, padded, dtype=values.dtype, device=values.device)
        x[:, _positions(tuple(segments), values.device)] = values
    blocks = x.view(rows, -1, BLOCK)
    if rotate:
        blocks = hadamard_rotate(blocks.float())
    qmax = 2 ** (bits - 1) - 1
    scales = _bfloat16_at_least(blocks.abs().amax(dim=-1).float() / qmax)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).float().unsqueeze(-1)
    codes = blocks / safe  # float32: the codes, rounded in place below
    if stochastic:
        _add_content_seeded_uniform(codes)
        codes.floor_()
    else:
        codes.round_()
    codes.clamp_(-qmax, qmax)
    restored = None
    if restore:
        # + 0.0 turns a code of -0.0 (rounded from a small negative value) into the +0.0 an unpacked code gives.
        dequantized = (codes * scales.float().unsqueeze(-1)).add_(0.0)
        if rotate:
            dequantized = hadamard_rotate(dequantized)
        restored = dequantized.view(rows, padded)
        if padded != n:
            restored = restored[:, _positions(tuple(segments), values.device)]
    code_len = padded * bits // 8
    payload = torch.empty(rows, code_len + 2 * (padded // BLOCK), dtype=torch.uint8, device=values.device)
    codes = codes.view(rows, padded)
    if bits == 4:
        # Two codes per byte, offset by 8 to be non-negative: low nibble first. Integers below 256 are exact in
        # float32, so the byte is assembled there and converted once.
        pairs = codes.add_(8).view(rows, padded // 2, 2)
        payload[:, :code_len].copy_(torch.add(pairs[..., 0], pairs[..., 1], alpha=16))
    else:
        payload[:, :code_len].view(torch.int8).copy_(codes)
    payload[:, code_len:].copy_(scales.view(torch.uint8).view(rows, -1))
    return payload, restored


def decode(payload: torch.Tensor, n: int, bits: int, rotate: bool = False,
           segments: list[int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 payload rows -> float32 rows (rows, n): what `encode` sent, as every receiver reconstructs it. Given
    `out` (rows, n) of any float dtype, the float32 values are rounded into it (in the same pass where possible)."""
    rows = payload.shape[0]
    segments = segments or [n]
    padded = padded_length(segments)
    code_len = padded * bits // 8
    code_bytes, scale_bytes = payload[:, :code_len], payload[:, code_len:]
    if bits == 4:
        low = (code_bytes & 0x0F).to(torch.int16) - 8
        high = (code_bytes >> 4).to(torch.int16) - 8
        codes = torch.stack((low, high), dim=-1).view(rows, -1, BLOCK)
    else:
        codes = code_bytes.view(torch.int8).view(rows, -1, BLOCK)
    scales = scale_bytes.contiguous().view(torch.bfloat16).float().view(rows, -1, 1)
    # Integer codes times float32 scales multiply in float32 (exact conversion), whatever `out`'s dtype.
    if out is not None and padded == n and not rotate:
        torch.mul(codes, scales, out=out.view(rows, -1, BLOCK))
        return out
    blocks = codes * scales
    if rotate:
        blocks = hadamard_rotate(blocks)
    restored = blocks.view(rows, padded)
    if padded != n:
        restored = restored[:, _positions(tuple(segments), payload.device)]
    return restored if out is None else out.copy_(restored)


def relative_error(values: torch.Tensor, bits: int, stochastic: bool = False, rotate: bool = False) -> float:
    """Relative L2 error of one round trip through the wire format (the figure docs/recipes.md reports)."""
    rows = values.reshape(1, -1).float()
    restored = decode(encode(rows, bits, stochastic, rotate), rows.shape[1], bits, rotate)
    return float((restored - rows).norm() / rows.norm().clamp_min(1e-30))
