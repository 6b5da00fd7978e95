"""`pdserve plan`: the smallest deployment that meets the latency target, found by simulation.

In: a model, the accelerator types allowed per pool and the tensor-parallel degrees to try, a
GPU budget, a workload at a rate and the SLO. It simulates every split (prefill replicas x TP,
decode replicas x TP, each pool on each allowed accelerator, and colocated pools unless told
not to) that fits the budget, and recommends the one with the fewest GPUs whose SLO attainment
reaches the SLO's percentile and whose inter-token gaps stay inside the ITL target at that
percentile too (attainment counts a request's mean gap, TPOT, as `pdserve bench` does; a stall
that a mean hides still shows in the gaps' tail) (ties: the most goodput per GPU). Out: every candidate's figures,
the frontier (per GPU count, the best candidate), the recommended pdserve config (what
`pdserve serve` and the Helm chart's `config` value take) and, with matplotlib, a plot of the
frontier.

Each candidate runs the same requests (one draw of the workload). A draw shorter than a few
request lifetimes never fills the decode pool and flatters every split; near the boundary a
candidate may land on either side: confirm the recommendation with a longer `pdserve simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

from pdserve.simulate.sim import PoolSpec, SimConfig, Simulation, num_kv_blocks


@dataclass(frozen=True)
class Candidate:
    decode: PoolSpec
    prefill: PoolSpec | None  # None: colocated

    @property
    def num_gpus(self) -> int:
        return self.decode.num_replicas * self.decode.tp + (
            self.prefill.num_replicas * self.prefill.tp if self.prefill else 0)

    def describe(self) -> str:
        d = f"{self.decode.num_replicas} x {self.decode.accelerator.name} TP{self.decode.tp}"
        if self.prefill is None:
            return f"colocated {d}"
        return f"prefill {self.prefill.num_replicas} x {self.prefill.accelerator.name} TP{self.prefill.tp}, decode {d}"


def _fits(base: SimConfig, pool: PoolSpec) -> bool:
    try:
        num_kv_blocks(base.model, pool, base.block_size)
    except ValueError:
        return False
    return True


def candidates(base: SimConfig, accelerators: list, tps: Iterable[int], max_gpus: int,
               colocated: bool = True) -> list[Candidate]:
    """Every split that fits `max_gpus` and whose replicas hold the model."""
    pools = [PoolSpec(a, 1, tp) for a in accelerators for tp in sorted(set(tps))]
    pools = [p for p in pools if _fits(base, p)]
    out = []
    for d in pools:
        if colocated:
            out += [Candidate(replace(d, num_replicas=n), None) for n in range(1, max_gpus // d.tp + 1)]
        for p in pools:
            for num_p in range(1, (max_gpus - d.tp) // p.tp + 1):
                for num_d in range(1, (max_gpus - num_p * p.tp) // d.tp + 1):
                    out.append(Candidate(replace(d, num_replicas=num_d), replace(p, num_replicas=num_p)))
    return out


def evaluate(base: SimConfig, candidate: Candidate, requests: list) -> dict:
    result = Simulation(replace(base, decode=candidate.decode, prefill=candidate.prefill)).run(iter(requests))
    good = result["goodput_rps"] or 0.0
    return {"candidate": candidate.describe(), "num_gpus": candidate.num_gpus,
            "slo_attainment": result["slo_attainment"], "goodput_rps": good,
            "goodput_per_gpu": good / candidate.num_gpus, "ttft_ms": result["ttft_ms"], "itl_ms": result["itl_ms"]}


def search(base: SimConfig, pool: list[Candidate], requests: list,
           progress: Callable[[], None] | None = None) -> tuple[list[dict], dict | None]:
    """(every candidate's figures, the recommended one or None when none meets the SLO)."""
    rows = []
    for c in pool:
        row = evaluate(base, c, requests)
        row["_candidate"] = c
        rows.append(row)
        progress and progress()
    meeting = [r for r in rows if meets(r, base.slo)]
    best = min(meeting, key=lambda r: (r["num_gpus"], -r["goodput_per_gpu"]), default=None)
    return rows, best


def smallest(base: SimConfig, pool: list[Candidate], requests: list) -> tuple[dict | None, int]:
    """The search by GPU count, fewest first, stopping at the first count with a split that meets
    the SLO: (its best split or None, how many splits were simulated)."""
    tried = 0
    for gpus in sorted({c.num_gpus for c in pool}):
        rows, best = search(base, [c for c in pool if c.num_gpus == gpus], requests)
        tried += len(rows)
        if best:
            return best, tried
    return None, tried


def meets(row: dict, slo) -> bool:
    """Attainment at the SLO's percentile, and the gaps' tail at that percentile within the ITL target."""
    itl = row["itl_ms"].get(f"p{slo.percentile:g}")
    return (row["slo_attainment"] or 0) >= slo.attainment and (itl is None or itl <= slo.itl_s * 1000)


def frontier(rows: list[dict], slo) -> list[dict]:
    """Per GPU count, the best candidate: meeting the SLO first, then attainment, then goodput per GPU."""
    best: dict[int, tuple] = {}
    for r in rows:
        key = (meets(r, slo), r["slo_attainment"] or 0, r["goodput_per_gpu"])
        if r["num_gpus"] not in best or key > best[r["num_gpus"]][0]:
            best[r["num_gpus"]] = (key, r)
    return [best[g][1] for g in sorted(best)]


# Ray's accelerator_type names for the profiles (ray.util.accelerators); MI300X has none in Ray's
# list, so its pools ask for GPUs only (put them on MI300X nodes with custom resources).
RAY_ACCELERATOR_TYPES = {"H100": "H100", "H200": "H200", "A100": "A100-80G"}


def pdserve_config(candidate: Candidate, model: str, slo) -> dict:
    """The pdserve config (YAML-able) for a candidate: pools, devices per replica, TP, the SLO."""
    def pool(p: PoolSpec) -> dict:
        if p.accelerator.name == "cpu":
            options = {"num_cpus": p.tp}
        else:
            options = {"num_gpus": p.tp}
            if p.accelerator.name in RAY_ACCELERATOR_TYPES:
                options["accelerator_type"] = RAY_ACCELERATOR_TYPES[p.accelerator.name]
        return {"num_replicas": p.num_replicas, "ray_actor_options": options,
                "engine": {"tensor_parallel_size": p.tp}}

    on_gpu = candidate.decode.accelerator.name != "cpu"
    config = {"model": model, "mode": "disaggregated" if candidate.prefill else "colocated",
              "slo": {"ttft_ms": slo.ttft_s * 1000, "itl_ms": slo.itl_s * 1000, "percentile": slo.percentile}}
    if on_gpu:
        config["engine"] = {"dtype": "bfloat16", "device": "cuda"}
    if candidate.prefill:
        config["prefill"] = pool(candidate.prefill)
    config["decode"] = pool(candidate.decode)
    return config


def plot(rows: list[dict], slo, path: str) -> str | None:
    """The frontier as a PNG (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [r for r in rows if meets(r, slo)]
    miss = [r for r in rows if not meets(r, slo)]
    ax.scatter([r["num_gpus"] for r in miss], [r["goodput_per_gpu"] for r in miss], c="lightgray", s=14,
               label="misses the SLO")
    ax.scatter([r["num_gpus"] for r in ok], [r["goodput_per_gpu"] for r in ok], c="tab:blue", s=18,
               label="meets the SLO")
    front = frontier(rows, slo)
    ax.plot([r["num_gpus"] for r in front], [r["goodput_per_gpu"] for r in front], c="tab:orange", lw=1,
            label="best per GPU count")
    ax.set_xlabel("GPUs (replicas x TP)")
    ax.set_ylabel("goodput per GPU (req/s within SLO)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
