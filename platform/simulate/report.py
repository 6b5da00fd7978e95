"""A simulation result as a short text table (the JSON carries everything)."""

from __future__ import annotations


def _ms(d: dict, key: str) -> str:
    value = d.get(key)
    return "-" if value is None else f"{value:.1f}"


def table(r: dict) -> str:
    slo = r["slo"]
    pct = f"p{slo['percentile']:g}"
    rows = [f"requests          {r['completed']} of {r['num_requests']} completed in {r['simulated_s']:.1f} "
            "simulated s",
            f"SLO               TTFT <= {slo['ttft_ms']:g} ms, ITL <= {slo['itl_ms']:g} ms at {pct}",
            "                  p50       p99       " + (f"{pct:<10}" if pct not in ("p50", "p99") else "") + "mean"]
    for name in ("ttft", "itl", "tpot"):
        d = r[f"{name}_ms"]
        extra = f"{_ms(d, pct):<10}" if pct not in ("p50", "p99") else ""
        rows.append(f"{name.upper() + ' ms':<18}{_ms(d, 'p50'):<10}{_ms(d, 'p99'):<10}{extra}{_ms(d, 'mean')}")
    attainment = r["slo_attainment"]
    rows += [f"SLO attainment    {'-' if attainment is None else f'{attainment:.3f}'}",
             f"goodput           {r['goodput_rps'] or 0:.2f} req/s, {r['goodput_per_replica'] or 0:.3f} per replica-s",
             "replica-seconds   " + ", ".join(f"{k} {v:.0f}" for k, v in r["replica_seconds"].items()),
             "final replicas    " + ", ".join(f"{k} {v}" for k, v in r["final_replicas"].items()),
             "placements        " + "; ".join(f"{k}: {v}" for k, v in r["placements"].items())
             + (f"; {r['recomputed']} recomputed (no blocks for the pull)" if r.get("recomputed") else ""),
             f"cost              {r['num_events']} events in {r['wall_s']:.1f} s wall "
             f"({r['real_time_ratio'] or 0:.2f}x real time)"]
    return "\n".join(rows)
