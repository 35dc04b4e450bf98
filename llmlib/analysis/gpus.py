"""Accelerators by name: each one's datasheet bandwidth, dense bf16 throughput and memory.

The figures are the vendors' published ones (each entry names its source), so the cost model and
the roofline can say what a model costs on hardware this book never ran on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """One accelerator's two ceilings, as its vendor publishes them.

    ``bf16_tflops`` is *dense* bf16 tensor-core throughput (datasheets headline the 2:4-sparse
    figure, which is twice this). ``ridge`` is the arithmetic intensity (FLOPs per byte) above
    which a kernel is compute-bound on this chip.
    """

    name: str
    bandwidth_tbs: float  # TB/s (1e12 bytes/s) of device memory bandwidth
    bf16_tflops: float  # dense bf16 tensor-core TFLOP/s
    memory_gb: float  # device memory capacity, GB
    source: str
    link_gbs: float = 0.0  # GB/s each way between GPUs of one machine (NVLink, else PCIe)
    link: str = ""  # what that link is, and where the figure comes from

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return self.bandwidth_tbs * 1e12

    @property
    def flops(self) -> float:
        """Dense bf16 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def link_bandwidth(self) -> float:
        """Bytes per second each way on the GPU-to-GPU link (what a ring all-reduce streams over)."""
        return self.link_gbs * 1e9

    @property
    def ridge(self) -> float:
        """FLOPs per byte where the compute roof meets the bandwidth roof."""
        return self.flops / self.bandwidth


GPUS: dict[str, GPU] = {
    "h100-sxm": GPU(
        "NVIDIA H100 SXM 80GB",
        3.35,
        989.0,
        80,
        "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3; "
        "BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense",
        450.0,
        "NVLink 4: the H100 SXM datasheet's 900 GB/s counts both directions, so 450 GB/s each way",
    ),
    "h200": GPU(
        "NVIDIA H200 SXM 141GB",
        4.8,
        989.0,
        141,
        "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e; "
        "BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989 dense",
        450.0,
        "NVLink 4: the H200 SXM datasheet's 900 GB/s counts both directions, so 450 GB/s each way",
    ),
    "a100-80gb": GPU(
        "NVIDIA A100 80GB SXM",
        2.039,
        312.0,
        80,
        "NVIDIA A100 Tensor Core GPU datasheet: 2,039 GB/s HBM2e (80GB SXM); "
        "BF16 Tensor Core 312 TFLOPS dense (624 sparse)",
        300.0,
        "NVLink 3: the A100 datasheet's 600 GB/s counts both directions, so 300 GB/s each way",
    ),
    "l4": GPU(
        "NVIDIA L4 24GB",
        0.300,
        121.0,
        24,
        "NVIDIA L4 Tensor Core GPU datasheet: 300 GB/s GDDR6; "
        "BF16 Tensor Core 242 TFLOPS with sparsity -> 121 dense",
        32.0,
        "no NVLink: PCIe Gen4 x16 (the L4 datasheet's 64 GB/s counts both directions)",
    ),
    "rtx-4090": GPU(
        "NVIDIA GeForce RTX 4090 24GB",
        1.008,
        165.2,
        24,
        "NVIDIA Ada GPU Architecture whitepaper, RTX 4090 column: 1,008 GB/s GDDR6X; peak BF16 Tensor TFLOPS "
        "with FP32 accumulate 165.2 dense (330.4 sparse). (82.6 is its FP32/TF32 rate, not bf16.)",
        32.0,
        "no NVLink: PCIe Gen4 x16, about 32 GB/s each way",
    ),
}


def get_gpu(name_or_gpu: str | GPU) -> GPU:
    """A GPU from :data:`GPUS` by key (``h100-sxm``, ``h200``, ``a100-80gb``, ``l4``, ``rtx-4090``)."""
    if isinstance(name_or_gpu, GPU):
        return name_or_gpu
    key = str(name_or_gpu).lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu {name_or_gpu!r}; known: {', '.join(GPUS)}")
    return GPUS[key]
