"""Accelerator profiles the roofline reads: memory bandwidth, peak FLOP/s, links, memory size.

The GPU rows are public spec-sheet figures (dense bf16, no sparsity; SXM / OAM parts):
- H100 SXM5 80 GB: HBM3 3.35 TB/s, 989 TFLOP/s bf16 dense (1,979 "with sparsity"), NVLink 4
  900 GB/s; NVIDIA H100 Tensor Core GPU datasheet.
- H200 SXM 141 GB: HBM3e 4.8 TB/s, 989 TFLOP/s bf16 dense, NVLink 900 GB/s; NVIDIA H200 datasheet.
- A100 SXM4 80 GB: HBM2e 2,039 GB/s, 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s; NVIDIA A100 datasheet.
- MI300X 192 GB: HBM3 5.3 TB/s, 1,307.4 TFLOP/s bf16 dense, Infinity Fabric 896 GB/s (7 x 128);
  AMD Instinct MI300X data sheet.
`link_bytes_per_s` is what a KV pull between replicas on different hosts gets: one 400 Gb/s
NIC per GPU (ConnectX-7 NDR, 50 GB/s) on H100, H200 and MI300X hosts, 200 Gb/s HDR on A100 hosts.
Spec figures are peaks: the roofline from them is a lower bound on step time (`step_overhead_s`
0); measured engines add scheduling, sampling and launch time.

`cpu` is this machine's engine, calibrated: `pdserve simulate calibrate` measures the real
engine's steps and fits its effective rates (calibration.py): a CPU does not overlap streaming
with arithmetic, and its attention reads KV far below its weight-streaming rate, so the cpu
profile is additive with an attention bandwidth of its own. The result ships as
cpu_calibration.json beside this module, with the machine it was measured on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

CPU_CALIBRATION = Path(__file__).with_name("cpu_calibration.json")
GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_per_s: float
    flops_per_s: float
    link_bytes_per_s: float  # KV pulls between replicas
    interconnect_bytes_per_s: float  # within a tensor-parallel replica
    memory_bytes: float
    step_overhead_s: float = 0.0
    kv_cache_bytes: float | None = None  # None: what the weights leave of memory_bytes (MEMORY_UTILIZATION)
    source: str = ""
    attention_bytes_per_s: float | None = None  # reading KV in attention, where slower than streaming weights
    is_additive: bool = False  # memory and compute take turns (a CPU) instead of overlapping (a GPU)

    def kv_cache_bytes_for(self, weight_bytes: float, tp: int = 1) -> float:
        """KV-cache bytes a replica of `tp` such devices has beside `weight_bytes` of weights."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes * tp
        return MEMORY_UTILIZATION * self.memory_bytes * tp - weight_bytes


# The share of device memory an engine takes (vLLM's gpu_memory_utilization default).
MEMORY_UTILIZATION = 0.9

PROFILES: dict[str, Accelerator] = {
    "H100": Accelerator("H100", 3.35e12, 989e12, 50 * GB, 900 * GB, 80 * GB, source="H100 SXM5 datasheet"),
    "H200": Accelerator("H200", 4.8e12, 989e12, 50 * GB, 900 * GB, 141 * GB, source="H200 SXM datasheet"),
    "A100": Accelerator("A100", 2.039e12, 312e12, 25 * GB, 600 * GB, 80 * GB, source="A100 SXM4 80GB datasheet"),
    "MI300X": Accelerator("MI300X", 5.3e12, 1307.4e12, 50 * GB, 896 * GB, 192 * GB, source="MI300X data sheet"),
}


def load_cpu(path: Path = CPU_CALIBRATION) -> Accelerator:
    """The calibrated `cpu` profile (calibration.py writes the file)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: no CPU calibration ({e.strerror}); run `pdserve simulate calibrate`") from None
    names = {f.name for f in fields(Accelerator)}
    return Accelerator(**{k: v for k, v in data["profile"].items() if k in names})


def accelerator(name: str, cpu_calibration: Path | None = None) -> Accelerator:
    if name == "cpu":
        return load_cpu(cpu_calibration or CPU_CALIBRATION)
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"accelerator {name!r}: choose from {', '.join([*PROFILES, 'cpu'])}") from None
