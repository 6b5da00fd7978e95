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

`Host` is the rest of this machine as the real app ran on it (cpu_host.json, measured by
`benchmarks/simulator_host.py`): every replica and the request path (HTTP, HAProxy, the gateway,
Ray's calls and daemons, the benchmark's client) share its cores, which no accelerator profile
says, and a request's path costs latency and CPU time outside the engines' steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

CPU_CALIBRATION = Path(__file__).with_name("cpu_calibration.json")
CPU_HOST = Path(__file__).with_name("cpu_host.json")
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


@dataclass(frozen=True)
class Host:
    """One machine that every simulated replica and the request path share. A replica's own
    Python (its Ray calls, the outputs it streams, a KV pull's handling) shares a lock with its
    engine thread, so part of it lengthens that replica's steps: a decode step's own cost, spread
    as measured (`decode_step_s` and its percentiles about it, `decode_step_jitter_s`: the host's
    noise makes the gaps' tail), a stream's, a request joining (`decode_join_s`), and a prefill
    replica's per prompt; the rest of a decode replica's per request (`decode_request_s`,
    `decode_s_per_prompt_token`) runs beside its engine on the other cores, like the rest of the
    path (HAProxy, the gateway, Ray's daemons, the client), which only takes cores. Engines'
    steps stretch when more is busy than there are cores (`SharedCores`, replicas.py). A
    request's first token comes `local_path_s` (and a cost per prompt token) later than its engine
    work alone gives (the way in and out), `remote_path_s` when prefilled by the prefill pool (its
    Ray call, the pull's round trips, the join). Costs per prompt token are per token computed; a
    token found in the prefix cache costs its own, measured apart (`..._per_cached_token`): much
    of a computed token's is the app's prefill running slower than the engine alone."""
    cores: float
    idle_cores: float  # cores busy with the app deployed and idle (Ray's daemons, Serve's controller)
    request_cpu_s: float  # CPU seconds a request costs outside the replicas' processes
    token_cpu_s: float  # and each streamed token
    decode_request_s: float  # in the decode replica's process, beyond its engine's steps: a request
    decode_step_s: float  # what each of its steps takes longer than the engine's own (the median)
    decode_token_s: float  # and each stream of the step
    prefill_request_s: float  # in the prefill replica's process, a request
    local_path_s: float
    remote_path_s: float
    local_path_s_per_prompt_token: float = 0.0  # tokenizing, and the like
    remote_path_s_per_prompt_token: float = 0.0  # and the KV pull's handling, the join
    decode_s_per_prompt_token: float = 0.0  # a request's cost in each replica's process grows with its prompt
    prefill_s_per_prompt_token: float = 0.0
    local_path_s_per_cached_token: float = 0.0  # the same for a prompt token found cached
    remote_path_s_per_cached_token: float = 0.0
    decode_s_per_cached_token: float = 0.0
    prefill_s_per_cached_token: float = 0.0
    decode_join_s: float = 0.0  # of decode_request_s, what lengthens the step the request joins in
    decode_step_jitter_s: tuple[float, ...] = ()  # a step's own cost less its median, at evenly spaced percentiles
    source: str = ""

    @staticmethod
    def _by_tokens(prompt_tokens: int, cached_tokens: int, per_computed: float, per_cached: float) -> float:
        return (prompt_tokens - cached_tokens) * per_computed + cached_tokens * per_cached

    def local_delay_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        return self.local_path_s + self._by_tokens(prompt_tokens, cached_tokens, self.local_path_s_per_prompt_token,
                                                   self.local_path_s_per_cached_token)

    def remote_delay_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """What a remote prefill adds to the local path's delay besides the prefill replica's own
        Python (which its steps carry)."""
        remote = self.remote_path_s + self._by_tokens(prompt_tokens, cached_tokens, self.remote_path_s_per_prompt_token,
                                                      self.remote_path_s_per_cached_token)
        return max(0.0, remote - self.local_delay_s(prompt_tokens, cached_tokens)
                   - self.prefill_own_s(prompt_tokens, cached_tokens))

    def prefill_own_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        """The prefill replica's own Python for a prompt it hands over."""
        return self.prefill_request_s + self._by_tokens(prompt_tokens, cached_tokens, self.prefill_s_per_prompt_token,
                                                        self.prefill_s_per_cached_token)

    def decode_prompt_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        """The decode replica's own Python for a request's prompt (its pull's handling and the like)."""
        return self._by_tokens(prompt_tokens, cached_tokens, self.decode_s_per_prompt_token,
                               self.decode_s_per_cached_token)


def load_host(path: Path = CPU_HOST) -> Host:
    """This machine's `Host` (benchmarks/simulator_host.py writes the file)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: no host measurement ({e.strerror}); run `python benchmarks/simulator_host.py "
                         "--write`") from None
    names = {f.name for f in fields(Host)}
    host = {k: tuple(v) if isinstance(v, list) else v for k, v in data["host"].items() if k in names}
    return Host(**host)


def accelerator(name: str, cpu_calibration: Path | None = None) -> Accelerator:
    if name == "cpu":
        return load_cpu(cpu_calibration or CPU_CALIBRATION)
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"accelerator {name!r}: choose from {', '.join([*PROFILES, 'cpu'])}") from None
