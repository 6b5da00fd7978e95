"""The chart checks `config` when it renders, as `pdserve config validate` does: a config with
problems fails `helm template`/`install` with every problem at once, each at its field path with
what is wrong and what the field is for, whether `config` is a map or YAML text. The template's
report is compared with config_check's on the same configs (a chart holding only the check renders
the report for many configs quickly; the real chart shows it when it fails)."""

from __future__ import annotations

import itertools
import shutil
from typing import Any

import pytest
import yaml

from pdserve.config_check import check
from tests.helm.conftest import CHART

# Differences that are the chart's own: no did-you-mean for a misspelt field (the hint lists the
# fields instead); API keys refused in the config (values.yaml: apiKeys); the ray_actor_options
# the chart sizes pods from must be numbers (Ray would refuse others later, in the cluster).


def _chart_only(path: str) -> bool:
    return path == "gateway.api_keys" or ".ray_actor_options." in path

MISTAKES = [
    # types, bounds, choices and patterns, at every level
    {"mode": "split", "name": 3, "slo": {"ttft_ms": 0, "itl_ms": "soon", "percentile": 101},
     "engine": {"max_num_seqs": 0, "dtype": "fp8", "device": "tpu", "block_size": 2.5,
                                               "seed": "x", "enforce_eager": 2, "num_kv_blocks": None},
     "prefill": {"num_replicas": "0", "health_check_period_s": 0, "max_queued_requests": -2,
                 "engine": {"tensor_parallel_size": None}, "autoscaling": {"target_kv_usage": 1.5}},
     "decode": {"engine": "tp4", "ray_actor_options": {"num_cpus": "one"}},
     "transfer": {"backend": "local", "lease_s": None}, "router": 5, "gateway": {"port": 70000, "host": None},
     "telemetry": {"traces": "jaeger", "sample_ratio": 2}},
    # unknown fields, at the top, in a pool, an engine and a nested model
    {"prefil": {}, "prefill": {"min_replicas": 2, "engine": {"model": "/x", "blok_size": 3}},
     "decode": {"autoscaling": {"min_replica": 1}}, "gateway": {"redis_url": "redis://h"}},
    # strings pydantic reads as numbers and booleans are fine; null where a field allows it
    {"slo": {"ttft_ms": "1500", "itl_ms": 50, "percentile": "99.9"},
     "engine": {"max_model_len": None, "enable_prefix_caching": "off", "max_num_seqs": "8"},
     "prefill": {"autoscaling": None}, "gateway": {"port": 0}, "pool_ratio": None},
    # an exclusive bound: the bound itself is refused
    {"slo": {"percentile": 100}},
    # a pool's merged engine: a budget too small, from the top-level engine or the pool's own
    {"engine": {"max_num_seqs": 4096}, "prefill": {"engine": {"max_num_batched_tokens": 8192}}},
    {"decode": {"engine": {"max_num_seqs": 600, "max_num_batched_tokens": 512}}, "gateway": {"port": "x"}},
    {"engine": {"max_num_seqs": 4096, "seed": "x"}},  # the top-level engine's own problem first
    # a model's checks across its fields
    {"prefill": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}},
     "decode": {"autoscaling": {"min_replicas": 0}, "engine": {"max_num_seqs": 4096}},
     "pool_ratio": {"min_prefill_per_decode": 2, "max_prefill_per_decode": 0.5}},
    {"decode": {"autoscaling": {"min_replicas": "0", "scale_to_zero": "true"}}},
    {"router": {"redis_url": "redis://:secret@redis:6379/0"}, "gateway": {"max_n": 0}},
    {"router": {"redis_url": "redis://redis:6379/0"}},
    # ServeConfig's own, once everything else is fine: all of them together
    {"prefill": {"engine": {"tensor_parallel_size": 4}}, "decode": {"engine": {"tensor_parallel_size": 2}},
     "pool_ratio": {}},
    # fields a config no longer takes: each named with what replaced it, beside the other problems
    {"remote_prefill_min_tokens": 256, "early_first_token": True, "engine": {"max_num_seqs": 0}},
    {"overflow_prefill_pause_s": 2.0, "prefill": {"engine": {"tensor_parallel_size": 4}}},
    {"mode": "colocated", "pool_ratio": {}, "decode": {"autoscaling": {}}},
    # the joint policy (slo, both pools autoscaling): its budget, and no pool_ratio beside it
    {"slo": {"ttft_ms": 900}, "pool_ratio": {}, "max_total_replicas": "3",
     "prefill": {"autoscaling": {"min_replicas": 2}}, "decode": {"autoscaling": {"min_replicas": "2"}}},
    {"max_total_replicas": 4, "decode": {"autoscaling": {}}},
]


@pytest.fixture(scope="session")
def report_chart(helm, tmp_path_factory):
    """A chart holding only the check, whose one template renders the report (empty: valid)."""
    root = tmp_path_factory.mktemp("check-chart")
    (root / "templates").mkdir()
    (root / "Chart.yaml").write_text("apiVersion: v2\nname: check\nversion: 0.1.0\n")
    shutil.copy(CHART / "templates" / "_config_check.tpl", root / "templates")
    shutil.copytree(CHART / "files", root / "files")
    (root / "templates" / "report.txt").write_text(
        '{{- $config := .Values.config | default dict -}}{{- if kindIs "string" $config -}}'
        '{{- $config = fromYaml $config -}}{{- end -}}'
        '{{- include "pdserve.configReport" (dict "root" . "config" $config) -}}')
    with helm.Chart.load(root) as chart:
        yield lambda config: chart.render({"config": config}, name="x", namespace="x")["check/templates/report.txt"]


def _parse(report: str) -> list[tuple[str, str, str]]:
    """The report's problems as (path, message, hint)."""
    if not report:
        return []
    header, *lines = report.split("\n")
    problems = []
    for line in lines:
        if line.startswith("      "):
            path, message, _ = problems[-1]
            problems[-1] = (path, message, line.strip())
        else:
            where, message = line.strip().split(": ", 1)
            problems.append(("" if where == "(config)" else where, message, ""))
    assert header == f"config: {len(problems)} problem" + ("s" if len(problems) > 1 else "")
    return problems


def _expected(config: dict) -> list[tuple[str, str, str]]:
    """config_check's problems, as the chart states them."""
    _, problems = check(config)
    expected = []
    for p in problems:
        if p.message.startswith("unknown field"):
            message = p.message.split(" (did you mean")[0]
            expected.append((p.path, message, "fields here: "))
        else:
            expected.append((p.path, p.message, p.hint))
    return sorted(expected)


def _comparable(problems: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return sorted((path, message, "fields here: " if hint.startswith("fields here: ") else hint)
                  for path, message, hint in problems if not _chart_only(path))


@pytest.mark.parametrize("index", range(len(MISTAKES)))
def test_the_chart_reports_what_config_validate_reports(report_chart, index):
    config = MISTAKES[index]
    from_map, from_text = report_chart(config), report_chart(yaml.safe_dump(config))
    assert _comparable(_parse(from_map)) == _expected(config), from_map
    assert from_text == from_map


def test_every_field_is_checked_for_its_type(report_chart):
    """One wrong value in every field that is not text: each is reported, as config_check reports it."""
    from pdserve.config import ServeConfig
    from pdserve.config_check import _model_of

    def wrong(model) -> dict:
        config = {}
        for name, field in model.model_fields.items():
            inner = _model_of(field.annotation)
            if inner is not None:
                config[name] = wrong(inner)
            elif field.annotation not in (str, str | None, Any):
                config[name] = [] if "dict" not in str(field.annotation) else "not a map"
        return config

    config = wrong(ServeConfig)
    problems = _parse(report_chart(config))
    assert len(problems) > 60 and _comparable(problems) == _expected(config)


def test_the_tensor_parallel_rule_agrees_with_serve_config(report_chart):
    """Every combination of the three places a degree can be set, in both modes."""
    degrees = [None, 1, 2, 3, 4]
    for mode, prefill, decode, top in itertools.product(["disaggregated", "colocated"], degrees, degrees, degrees):
        config: dict = {"mode": mode}
        for key, degree in (("prefill", prefill), ("decode", decode)):
            if degree:
                config[key] = {"engine": {"tensor_parallel_size": degree}}
        if top:
            config["engine"] = {"tensor_parallel_size": top}
        assert _comparable(_parse(report_chart(config))) == _expected(config), config


@pytest.mark.parametrize("form", ["map", "text"])
def test_a_bad_config_fails_the_render_with_the_whole_report(helm, render, form):
    config = {"engine": {"max_num_seqs": 0}, "prefill": {"num_replicas": 0}, "mode": "split",
              "gateway": {"api_keys": ["sk-inline"]}}
    with pytest.raises(helm.HelmError) as failed:
        render({"config": config if form == "map" else yaml.safe_dump(config)})
    message = str(failed.value)
    assert "Traceback" not in message and "executing" not in message, message
    assert message.endswith("""): config: 4 problems
  engine.max_num_seqs: Input should be greater than or equal to 1 (got 0)
      Most sequences in one batch.
  mode: Input should be 'disaggregated' or 'colocated' (got 'split')
      disaggregated: Prefill and Decode pools with KV transfer; colocated: one Unified pool, no transfer.
  prefill.num_replicas: Input should be greater than or equal to 1 (got 0)
      Replicas in this pool.
  gateway.api_keys: API keys given in the config would be rendered into the RayService's serveConfigV2 and shown on the Ray dashboard
      put them in apiKeys.keys (the chart keeps them in a Secret) or apiKeys.existingSecret"""), message


def test_text_that_is_no_mapping_is_reported(helm, render):
    for text in ("prefill: [1, 2", "- 1"):
        with pytest.raises(helm.HelmError, match="config: 1 problem\n  \\(config\\): not valid YAML, or not a mapping"):
            render({"config": text})
