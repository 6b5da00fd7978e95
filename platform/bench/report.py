"""What a person reads after a run: a short table, ratios between two results, sweep plots.

In: result dicts from `run_benchmark` (or their JSON files). Out: text, and PNG files for sweeps.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.metrics import MaxGoodput, max_goodput_rate

ROWS = [("completed", "requests completed", "{:.0f}"), ("failed", "requests failed", "{:.0f}"),
        ("duration", "duration (s)", "{:.2f}"), ("request_throughput", "requests/s", "{:.2f}"),
        ("output_throughput", "output tokens/s", "{:.1f}"), ("request_goodput", "goodput (requests/s)", "{:.2f}"),
        ("slo_attainment", "within SLO (share)", "{:.3f}"),
        ("mean_ttft_ms", "TTFT mean (ms)", "{:.1f}"), ("median_ttft_ms", "TTFT median (ms)", "{:.1f}"),
        ("p99_ttft_ms", "TTFT p99 (ms)", "{:.1f}"), ("mean_tpot_ms", "TPOT mean (ms)", "{:.2f}"),
        ("median_itl_ms", "ITL median (ms)", "{:.2f}"), ("p99_itl_ms", "ITL p99 (ms)", "{:.2f}"),
        ("median_e2el_ms", "E2E median (ms)", "{:.1f}"), ("p99_e2el_ms", "E2E p99 (ms)", "{:.1f}")]


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def table(result: dict) -> str:
    lines = [f"{'metric':<24} {'value':>12}", "-" * 37]
    lines += [f"{label:<24} {_fmt(fmt, result.get(key)):>12}" for key, label, fmt in ROWS if key in result]
    if result.get("errors"):
        lines.append("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(result["errors"].items())))
        for kind, detail in result.get("error_examples", {}).items():
            lines.append(f"  e.g. {kind}: {detail}")
    if not result.get("exact_token_counts"):
        lines.append("note: prompt token counts are approximate (no --tokenizer given)")
    return "\n".join(lines)


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    lines = [f"{'metric':<24} {name_a[:12]:>12} {name_b[:12]:>12} {'B/A':>8}", "-" * 59]
    for key, label, fmt in ROWS:
        va, vb = a.get(key), b.get(key)
        ratio = f"{vb / va:.2f}x" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        lines.append(f"{label:<24} {_fmt(fmt, va):>12} {_fmt(fmt, vb):>12} {ratio:>8}")
    return "\n".join(lines)


def load(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a benchmark result file ({e})") from e


def sweep_table(results: list[dict], load_key: str, attainment: float = 0.9) -> str:
    head = f"{load_key:>12} {'req/s':>8} {'out tok/s':>10} {'goodput':>8} {'TTFT p50':>9} {'TTFT p99':>9} " \
           f"{'ITL p50':>8} {'ITL p99':>8} {'failed':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{str(r[load_key]):>12} {r['request_throughput']:>8.2f} {r['output_throughput']:>10.1f} "
                     f"{_fmt('{:.2f}', r.get('request_goodput')):>8} {r['median_ttft_ms']:>9.1f} "
                     f"{r['p99_ttft_ms']:>9.1f} {r['median_itl_ms']:>8.2f} {r['p99_itl_ms']:>8.2f} {r['failed']:>6}")
    if _rates_with_slo(results, load_key):
        lines.append(max_goodput_line(max_goodput(results, attainment), attainment))
    return "\n".join(lines)


def _rates_with_slo(results: list[dict], load_key: str) -> bool:
    return load_key == "rate" and all(r.get("slo_attainment") is not None for r in results)


def max_goodput(results: list[dict], attainment: float) -> MaxGoodput | None:
    """DistServe's goodput over a rate sweep's results (see `metrics.max_goodput_rate`)."""
    return max_goodput_rate([(float(r["rate"]), r["slo_attainment"]) for r in results], attainment)


def max_goodput_line(g: MaxGoodput | None, attainment: float) -> str:
    share = f"{attainment:.0%} of requests within SLO"
    if g is None:
        return f"max goodput: under the lowest rate measured ({share} at no rate)"
    return f"max goodput: {'' if g.exact else 'at least '}{g.rate:.2f} req/s ({share})"


def sweep_plots(results: list[dict], load_key: str, out_dir: Path, cdfs: list[tuple[str, list[float]]],
                attainment: float = 0.9) -> list[Path]:
    """Latency percentiles and goodput against offered load; latency CDF per load point."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("sweep plots need matplotlib: pip install 'pdserve[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    x = [float(r[load_key]) for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, ax in zip(("ttft", "itl"), axes[:2]):
        for p, style in (("median", "-o"), ("p90", "--s"), ("p99", ":^")):
            ax.plot(x, [r.get(f"{p}_{name}_ms") for r in results], style, label=p)
        ax.set(xlabel=f"offered load ({load_key})", ylabel=f"{name.upper()} (ms)", title=f"{name.upper()} vs load")
        ax.grid(alpha=0.3)
        ax.legend()
    goodput = [r.get("request_goodput") for r in results]
    axes[2].plot(x, [r["request_throughput"] for r in results], "-o", label="throughput")
    if any(g is not None for g in goodput):
        axes[2].plot(x, [g or 0 for g in goodput], "--s", label="goodput (SLO met)")
        best = max_goodput(results, attainment) if _rates_with_slo(results, load_key) else None
        if best is not None:
            axes[2].axvline(best.rate, color="gray", linestyle=":",
                            label=f"{'≥ ' if not best.exact else ''}{best.rate:.2f} req/s with {attainment:.0%} in SLO")
    axes[2].set(xlabel=f"offered load ({load_key})", ylabel="requests/s", title="throughput and goodput")
    axes[2].grid(alpha=0.3)
    axes[2].legend()
    fig.tight_layout()
    load_png = out_dir / "sweep_load.png"
    fig.savefig(load_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, values in cdfs:
        values = sorted(values)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.set(xlabel="end-to-end latency (ms)", ylabel="fraction of requests", title="latency CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    cdf_png = out_dir / "sweep_latency_cdf.png"
    fig.savefig(cdf_png, dpi=110)
    plt.close(fig)
    return [load_png, cdf_png]
