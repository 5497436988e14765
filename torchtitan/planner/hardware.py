"""Published specifications of the GPUs the planner and the dry run know (vendor datasheets, dense figures).

Memory is what the device reports as total (`torch.cuda.mem_get_info`), in GiB. Bandwidths are per GPU and per
direction: NVLink within a host, the RDMA network card(s) between hosts.
"""

from dataclasses import dataclass

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
    """The fraction of the bf16 peak large GEMMs reached when measured (scripts/calibrate_gpu.py); None: the
    model's fitted efficiency."""
    allocator_fraction: float | None = None
    """What the caching allocator reserved beyond the live tensors when measured; None: the published figure
    (planner/search.py, ALLOCATOR_FRAGMENTATION)."""
    calibration: str = ""
    """The calibration file whose figures these are; empty: datasheet and published figures."""

    def attention_rates(self, head_dim: int) -> AttentionRates:
        return self.attention or published_rates(self.bf16_flops, head_dim)


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
        rdma_bytes_per_s=25e9),
    GPU("b200", "B200 180 GB (HBM3e), NVLink 5, 400 Gb/s RDMA per GPU", memory_gib=178.4, bf16_flops=2250e12,
        fp8_flops=4500e12, hbm_bytes_per_s=8e12, nvlink_bytes_per_s=900e9, rdma_bytes_per_s=50e9),
)}


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
