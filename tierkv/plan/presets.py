"""Model and hardware presets for the capacity planner (public figures)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelPreset:
    """A model's shape as the KV cache sees it."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params_b: float  # billions of parameters
    kv_dtype_bytes: int = 2
    weight_bytes: float = 2.0  # per parameter (fp16/bf16)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def weights_gb(self) -> float:
        """Weight memory in GB (1e9 bytes)."""
        return self.params_b * self.weight_bytes


@dataclass(frozen=True)
class GpuPreset:
    """A GPU as the planner sees it: memory and the bandwidths that bound a decode step."""

    name: str
    memory_gb: float
    hbm_gbps: float  # device memory bandwidth, GB/s
    pcie_gbps: float  # host <-> device, achievable, GB/s per direction
    nvlink_gbps: float  # GPU <-> GPU, GB/s per direction
    tflops: float  # dense bf16 peak, TFLOP/s


MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset("llama-2-70b", layers=80, kv_heads=8, head_dim=128, params_b=69.0),
        ModelPreset("llama-3-8b", layers=32, kv_heads=8, head_dim=128, params_b=8.0),
        ModelPreset("llama-3-70b", layers=80, kv_heads=8, head_dim=128, params_b=70.6),
        ModelPreset("qwen2-7b", layers=28, kv_heads=4, head_dim=128, params_b=7.6),
        ModelPreset("qwen2-72b", layers=80, kv_heads=8, head_dim=128, params_b=72.7),
    )
}

GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("a100-80gb", 80, hbm_gbps=2039, pcie_gbps=25, nvlink_gbps=300, tflops=312),
        GpuPreset("h100-80gb", 80, hbm_gbps=3350, pcie_gbps=50, nvlink_gbps=450, tflops=989),
        GpuPreset("h200", 141, hbm_gbps=4800, pcie_gbps=50, nvlink_gbps=450, tflops=989),
    )
}
