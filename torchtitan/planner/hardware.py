"""Published specifications of the GPUs the planner and the dry run know (vendor datasheets, dense figures), and
how long a matrix product of a given shape takes on each (gemm_seconds).

Memory is what the device reports as total (`torch.cuda.mem_get_info`), in GiB. Bandwidths are per GPU and per
direction: NVLink within a host, the RDMA network card(s) between hosts.
"""

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from torchtitan.errors import UserError
from torchtitan.planner.attention import AttentionRates, published_rates


@dataclass(frozen=True)
class GPU:
    name: str
    description: str
    memory_gib: float
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    rdma_bytes_per_s: float
    gpus_per_host: int = 8
    attention: AttentionRates | None = None
    """Attention kernel speeds measured on this GPU (scripts/calibrate_gpu.py); None: FlashAttention-2's
    published ones, scaled to the peak (planner/attention.py)."""
    gemm_efficiency: float | None = None
    """The fraction of the bf16 peak a large, well-shaped GEMM reaches on this GPU, from what
    scripts/calibrate_gpu.py measured (gemm_seconds); None: the model's fitted efficiency."""
    gemm_shapes: tuple[tuple[int, int, int, float], ...] = ()
    """bf16 GEMMs timed on this GPU (scripts/calibrate_gpu.py): (m, k, n, FLOP/s); a product of that shape takes
    the measured time (the mean, if timed more than once)."""
    gemm_level_vs_h100: float = 1.0
    """The fraction of its bf16 peak a large GEMM reaches on this GPU over the fraction an H100 SXM reaches, both
    measured by one benchmark (MAMF_PUBLISHED): the fitted efficiency (H100 rows) times it is this GPU's level."""
    flash_attention_vs_h100: float = 1.0
    """FlashAttention-2's fraction of this GPU's peak over its fraction of the H100's, from its published speeds on
    both (FLASH_A100_OVER_H100): the published H100 curves, scaled to this GPU's peak, times it."""
    allocator_fraction: float | None = None
    """What the caching allocator reserved beyond the live tensors when measured; None: the published figure
    (ALLOCATOR_FRAGMENTATION)."""
    calibration: str = ""
    """The calibration file whose figures these are; empty: datasheet and published figures."""

    @functools.cached_property
    def gemm_measured(self) -> dict[tuple[int, int, int], float]:
        """FLOP/s by timed shape; a shape timed more than once at the mean of its times."""
        inverse: dict[tuple[int, int, int], list[float]] = {}
        for m, k, n, flops in self.gemm_shapes:
            inverse.setdefault((m, k, n), []).append(1 / flops)
        return {shape: len(values) / sum(values) for shape, values in inverse.items()}

    def attention_rates(self, head_dim: int) -> AttentionRates:
        return self.attention or published_rates(self.bf16_flops * self.flash_attention_vs_h100, head_dim)


# The output tile of the kernels cuBLAS runs for large bf16 and float8 GEMMs on Hopper (CUTLASS's warp-specialised
# 128 x 256 x 64 tile; Ampere's largest is 256 x 128, the same area): a matrix whose rows or columns do not fill whole
# tiles computes the padding too (tile quantisation).
GEMM_TILE = (128, 256)


def gemm_seconds(m: float, k: float, n: float, gpu: GPU, efficiency: float, float8: bool = False) -> float:
    """Seconds of one (m x k) @ (k x n) product, by its shape, from first principles and no constant of its own:

    - the tensor cores compute whole output tiles (GEMM_TILE), padding included, at `efficiency` of the peak (the
      fitted level of a large, well-shaped GEMM);
    - they cannot run faster than HBM delivers the two inputs (each read once: bf16 2 bytes, float8 1): a thin
      matrix (a TP 8 shard of a 1,024-wide projection has 128 columns) is bound by reading the other one;
    - each tile's output (bf16) is written after its K loop, not under it: an additive m x n store, which is what
      makes a short K slow (at K = 128 the store costs as much as the multiply on an H100).

    Measured on one H100 SXM (docs/scaling.md, 208 shapes of the 8B, 70B and 405B blocks at TP 1-8, forward and
    both backward products): the block's rate at TP 8 within 5% of the measurement, where one efficiency for every
    shape was 15% off. Where the GPU was calibrated (scripts/calibrate_gpu.py), a shape it timed takes its time."""
    if gpu.gemm_shapes and not float8:
        measured = gpu.gemm_measured.get((round(m), round(k), round(n)))
        if measured:
            return 2 * m * k * n / measured
    tile_m, tile_n = GEMM_TILE
    padded = math.ceil(m / tile_m) * tile_m * math.ceil(n / tile_n) * tile_n
    peak = gpu.fp8_flops if float8 else gpu.bf16_flops
    multiply = 2 * padded * k / (peak * efficiency)
    read = (m * k + k * n) * (1 if float8 else 2) / gpu.hbm_bytes_per_s
    return max(multiply, read) + m * n * 2 / gpu.hbm_bytes_per_s


# The Maximum Achievable Matmul FLOPS of bf16 `matmul` (torch, CUDA 12.1; the best of a search over shapes), as a
# fraction of the datasheet peak: A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%); Stas Bekman's
# ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"
# (github.com/stas00/ml-engineering). One benchmark on both GPUs: what it leaves out of reach (clocks under load,
# the kernels cuBLAS has) differs between them, its method does not.
MAMF_PUBLISHED = {"a100": 267.9 / 312, "h100": 792.1 / 989}
# FlashAttention-2 on one A100 80 GB SXM4 reaches up to 230 TFLOP/s (its forward, head dim 128, no mask; Dao 2023,
# arXiv:2307.08691, section 4.1, Figures 4, 6 and 7: "up to 230 TFLOPs/s, 73% of the theoretical maximum"); the same
# curve on an H100 SXM peaks at 370 (FlashAttention-3 paper, arXiv:2407.08608, Figure 5, the figure attention.py
# takes): 73.7% of the A100's peak against 37.4% of the H100's (FlashAttention-2 does not use Hopper's warpgroup
# matrix instructions). The shape of the curves by length and mask is taken as the H100's.
FLASH_A100_OVER_H100 = (230e12 / 312e12) / (370e12 / 989e12)


GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in (
    GPU("h100", "H100 SXM 80 GB (HBM3, 700 W), NVLink 4, 400 Gb/s RDMA per GPU", memory_gib=79.6,
        bf16_flops=989e12, fp8_flops=1979e12, hbm_bytes_per_s=3.35e12, nvlink_bytes_per_s=450e9,
        rdma_bytes_per_s=50e9),
    GPU("h100_96gb", "H100 96 GB (HBM2e, 2.4 TB/s, 500 W power limit; TorchTitan's Grand Teton hosts), NVLink 4, "
        "400 Gb/s RDMA per GPU", memory_gib=95.6, bf16_flops=989e12, fp8_flops=1979e12, hbm_bytes_per_s=2.4e12,
        nvlink_bytes_per_s=450e9, rdma_bytes_per_s=50e9),
    GPU("h200", "H200 SXM 141 GB (HBM3e), NVLink 4, 400 Gb/s RDMA per GPU", memory_gib=139.8, bf16_flops=989e12,
        fp8_flops=1979e12, hbm_bytes_per_s=4.8e12, nvlink_bytes_per_s=450e9, rdma_bytes_per_s=50e9),
    GPU("a100", "A100 SXM 80 GB, NVLink 3, 200 Gb/s RDMA per GPU (no float8)", memory_gib=79.2,
        bf16_flops=312e12, fp8_flops=0.0, hbm_bytes_per_s=2.04e12, nvlink_bytes_per_s=300e9,
        rdma_bytes_per_s=25e9, gemm_level_vs_h100=MAMF_PUBLISHED["a100"] / MAMF_PUBLISHED["h100"],
        flash_attention_vs_h100=FLASH_A100_OVER_H100),
    GPU("b200", "B200 180 GB (HBM3e), NVLink 5, 400 Gb/s RDMA per GPU", memory_gib=178.4, bf16_flops=2250e12,
        fp8_flops=4500e12, hbm_bytes_per_s=8e12, nvlink_bytes_per_s=900e9, rdma_bytes_per_s=50e9),
)}


# What a GPU holds beyond the peak of live tensors (published or measured, not fitted), the same figure in the planner
# (search.py) and in the dry run's out-of-memory verdict (dry_run.check_fits):
# - the caching allocator's reserve: blocks it keeps cached and cannot hand to a tensor of another size or stream
#   (FSDP's all-gather and reduce-scatter streams keep pools of their own). Measured: one 8B rank (FSDP 8, compiled,
#   per-op AC, batch 2 x 8192) on an H200 with expandable segments, this framework's default and TorchTitan's,
#   reserved 72.93 GiB at the peak of 63.12 allocated (docs/scaling.md); scripts/calibrate_gpu.py measures it on
#   the GPU at hand;
# - the CUDA context, outside the allocator: the driver's state and the loaded kernels (CUDA 12's lazy loading loads
#   only the kernels a run calls); about 0.5 GiB on an H100 (torch.cuda.mem_get_info after the first kernel, less
#   what the allocator holds);
# - NCCL's buffers, outside the allocator, per communicator (one per process group of more than one rank): per
#   channel a buffer of NCCL_BUFFSIZE (4 MiB by default) for each of the ring's two connections and each of the
#   Simple and LL128 protocols, over the 16 channels NCCL opens on NVLink 4 hosts (NCCL's documented defaults).
ALLOCATOR_FRAGMENTATION = 0.155
CUDA_CONTEXT_GIB = 0.5
NCCL_COMMUNICATOR_GIB = 16 * 2 * 2 * 4 / 1024


@dataclass(frozen=True)
class Headroom:
    """GiB a GPU holds beyond the tensors' peak."""

    allocator_gib: float
    cuda_context_gib: float
    nccl_gib: float

    @property
    def total_gib(self) -> float:
        return self.allocator_gib + self.cuda_context_gib + self.nccl_gib


def communicators(layout: dict[str, int]) -> int:
    """NCCL communicators of a rank: the world's, and one per mesh dimension of more than one rank (FSDP's group is
    dp_shard x cp)."""
    degrees = [layout.get(name, 1) for name in ("pp", "dp_replicate", "tp", "cp")]
    degrees.append(layout.get("dp_shard", 1) * layout.get("cp", 1))
    world = 1
    for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
        world *= layout.get(name, 1)
    return (world > 1) + sum(degree > 1 for degree in degrees)


def headroom(tensor_peak_gib: float, gpu: GPU | None, layout: dict[str, int]) -> Headroom:
    """What a rank of `layout` (its degrees by mesh dimension) needs on `gpu` beyond `tensor_peak_gib` of tensors
    (the allocator's measured reserve where the GPU was calibrated)."""
    fraction = gpu.allocator_fraction if gpu is not None and gpu.allocator_fraction is not None else \
        ALLOCATOR_FRAGMENTATION
    return Headroom(allocator_gib=tensor_peak_gib * fraction, cuda_context_gib=CUDA_CONTEXT_GIB,
                    nccl_gib=communicators(layout) * NCCL_COMMUNICATOR_GIB)


def gpu_named(name: str, option: str) -> GPU:
    gpu = GPUS.get(name.lower())
    if gpu is None:
        raise UserError(f"option {option}: unknown GPU {name!r}; valid: {', '.join(GPUS)}")
    return gpu


def require_same_gpu(gpu: GPU, device_name: str, measured: str) -> None:
    """Refuse figures `measured` on a device other than the named GPU's family (an H100 96 GB is an H100)."""
    if gpu.name.split("_")[0].upper() not in device_name.upper():
        raise UserError(f"option --gpu: {gpu.name} ({gpu.description}), but {measured} ran on {device_name}: name "
                        f"the GPU the runs ran on")


# The file scripts/calibrate_gpu.py writes and `plan.py --calibrate FILE` reads.
CALIBRATION_FORMAT = "torchtitan-gpu-calibration/1"
ATTENTION_CURVES = (("forward", "causal"), ("forward", "full"), ("backward", "causal"), ("backward", "full"))


def gemm_level(gpu: GPU, measured: list[tuple[int, int, int, float]]) -> float:
    """The efficiency (fraction of the bf16 peak a large, well-shaped GEMM reaches) at which the shape model
    (gemm_seconds) takes as long over the `measured` products, (m, k, n, FLOP/s), as they took:
    by bisection, at most 1 (a CPU's --quick figures give a level far below any GPU's)."""
    bare = dataclasses.replace(gpu, gemm_shapes=())
    seconds = sum(2 * m * k * n / flops for m, k, n, flops in measured)
    low, high = 0.0, 1.0
    if sum(gemm_seconds(m, k, n, bare, high) for m, k, n, _ in measured) >= seconds:
        return high
    for _ in range(200):
        middle = (low + high) / 2
        if sum(gemm_seconds(m, k, n, bare, middle) for m, k, n, _ in measured) > seconds:
            low = middle
        else:
            high = middle
    return high


def calibrated_gpu(path: str, gpu: GPU) -> tuple[GPU, str]:
    """`gpu` with the figures measured in a calibration file in place of the datasheet's and the published ones:
    the bf16 GEMMs by shape (each timed shape its time; the level of the shape model, replacing the fitted
    efficiency, from all of them), the Float8 GEMM speed-up, attention's speed
    by length and mask, the allocator's reserve. Returns a note for a file measured on the CPU (`--device cpu
    --quick`: a check of the format, not figures of any GPU)."""
    option = "option --calibrate"
    try:
        record = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"{option}: cannot read {path} ({e.strerror})") from None
    except ValueError as e:
        raise UserError(f"{option}: {path} is not JSON ({e})") from None
    if not isinstance(record, dict) or record.get("format") != CALIBRATION_FORMAT:
        raise UserError(f"{option}: {path} is not a file of scripts/calibrate_gpu.py (format {CALIBRATION_FORMAT})")
    try:
        attention = record["attention"]
        seq_lens = tuple(int(n) for n in attention["seq_lens"])
        curves = tuple((direction, mask, tuple(float(x) for x in attention[f"{direction}_{mask}_flops"]))
                       for direction, mask in ATTENTION_CURVES)
        gemm_flops = float(record["gemm_bf16_flops"])
        # "gemm_grid" (optional): more shapes (every flavor's layers at each TP degree and two token counts).
        shapes = tuple((int(g["m"]), int(g["k"]), int(g["n"]), float(g["flops_per_s"]))
                       for g in [*record["gemm"], *record.get("gemm_grid", [])])
        speedup = record["float8_speedup"]
        allocator = record["allocator_fraction"]
        device_type, device = record["device_type"], record["device_name"]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{option}: {path} lacks or garbles {e} (rerun scripts/calibrate_gpu.py)") from None
    if any(len(values) != len(seq_lens) or min(values) <= 0 for _, _, values in curves) or gemm_flops <= 0 \
            or not shapes or min(flops for *_, flops in shapes) <= 0:
        raise UserError(f"{option}: {path} has an attention curve of the wrong length or a speed that is not "
                        f"positive (rerun scripts/calibrate_gpu.py)")
    note = ""
    if device_type == "cuda":
        require_same_gpu(gpu, device, path)
    else:
        note = (f"{path} was measured on the {device_type} ({device}) with --quick: it checks the file's format; "
                f"its figures are not those of a {gpu.name}")
    fp8_flops = gpu.bf16_flops * float(speedup) if speedup and gpu.fp8_flops else gpu.fp8_flops
    return dataclasses.replace(
        gpu, attention=AttentionRates(seq_lens=seq_lens, curves=curves, source=f"measured ({path})"),
        gemm_efficiency=gemm_level(gpu, list(shapes)), gemm_shapes=shapes, fp8_flops=fp8_flops,
        allocator_fraction=None if allocator is None else float(allocator), calibration=str(path)), note
