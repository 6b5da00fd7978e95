"""The Grafana dashboard under deploy/ plots every pdserve series, by the names Ray exports."""

import json
import re
from pathlib import Path

from ray.util.metrics import Counter, Histogram

from pdserve.telemetry.metrics import series

DASHBOARD = Path(__file__).parents[3] / "deploy" / "grafana" / "pdserve.json"


def exported_name(metric) -> str:
    """Ray prefixes `ray_`; Prometheus counters end in `_total`, histograms are read by bucket."""
    suffix = "_total" if isinstance(metric, Counter) else "_bucket" if isinstance(metric, Histogram) else ""
    return f"ray_{metric._name}{suffix}"


def test_every_series_is_plotted_and_every_plotted_series_exists():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    plotted = {m for e in exprs for m in re.findall(r"ray_pdserve_\w+", e)}
    defined = {exported_name(m) for m in vars(series()).values()}
    assert all(name.startswith("ray_pdserve_") for name in defined)
    assert plotted <= defined, "panels plotting series pdserve does not define"
    assert defined - plotted == set(), "series without a panel"
