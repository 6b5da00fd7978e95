"""Pools map onto worker groups as the config and values say, the checks the CRD cannot make hold,
and upgrades that should not need a second cluster leave KubeRay's fingerprint of
rayClusterConfig unchanged."""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import yaml

from pdserve.config import ServeConfig
from tests.helm.conftest import CHART, CONFIGS, EXAMPLES, example_values

MAX_RAYSERVICE_NAME = 47  # KubeRay: 53 for a RayCluster, minus the 6 characters it appends


def _container(group: dict) -> dict:
    [container] = group["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("name", EXAMPLES)
def test_pools_map_onto_worker_groups(render, name):
    rendered = render(example_values(name))
    config = ServeConfig.model_validate(yaml.safe_load((CONFIGS / name).read_text()))
    pools = ["decode"] if config.mode == "colocated" else ["prefill", "decode"]
    assert [g["groupName"] for g in rendered.groups] == pools  # fixed order
    args = rendered.serve_config["applications"][0]["args"]
    for group in rendered.groups:
        pool_name = group["groupName"]
        pool = getattr(config, pool_name)
        ranks = config.model_copy(update={"model": "-"}).engine_config(pool).tensor_parallel_size
        options = pool.ray_actor_options
        tag = f"pdserve_{pool_name}"
        # The nodes carry the pool's tag; the pool's replicas ask for a share of it, nothing else does.
        assert group["resources"][tag] == "1"
        assert args[pool_name]["ray_actor_options"]["resources"] == {tag: 0.001}
        assert all(v == "1" or not k.startswith("pdserve_") or k == tag for k, v in group["resources"].items())
        # One replica per pod: Ray sees its CPUs; Kubernetes gives one core more, and its GPUs.
        cpus = math.ceil(options.get("num_cpus", 1) * ranks)
        gpus = math.ceil(options.get("num_gpus", 0) * ranks)
        assert group["resources"]["CPU"] == str(cpus)
        limits = _container(group)["resources"]["limits"]
        assert limits == _container(group)["resources"]["requests"]
        assert limits["cpu"] == str(cpus + 1)
        assert limits.get("nvidia.com/gpu", "0") == str(gpus)
        accelerator = options.get("accelerator_type")
        if accelerator:
            assert group["resources"][f"accelerator_type:{accelerator}"] == "1"
            assert group["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"].startswith("NVIDIA-")
        scaling = pool.autoscaling
        low, high = (scaling.min_replicas, scaling.max_replicas) if scaling else (pool.num_replicas,) * 2
        assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (
            low, min(max(pool.num_replicas, low), high), high)
        assert all(isinstance(v, str) for v in {**group["rayStartParams"], **group["resources"]}.values())
        assert {"name": "metrics", "containerPort": 8080} in _container(group)["ports"]


def test_the_head_has_no_accelerators_and_names_its_serve_ports(render):
    spec = render(example_values("mixtral-8x7b-ep.yaml")).rayservice["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]
    [container] = head["template"]["spec"]["containers"]
    assert not any("gpu" in key for key in container["resources"]["limits"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["serve"] == 8000 and ports["serve-grpc"] == 9000 and ports["dashboard"] == 8265
    assert head["rayStartParams"]["num-cpus"] == "0" and "resources" not in head
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["upscalingMode"] == "Default"


def test_values_override_the_derived_group_settings(render):
    values = {"pools": {"decode": {"replicas": 3, "minReplicas": 2, "maxReplicas": 5, "gpus": 2, "gpuVendor": "amd",
                                   "cpu": 16, "memory": "200Gi", "nodeSelector": {"pool": "decode"},
                                   "customResources": {"fast_disk": "1"}, "rayStartParams": {"object-store-memory": "1000000000"}}},
              "extraWorkerGroups": [{"name": "decode-spot", "pool": "decode", "maxReplicas": 2}]}
    rendered = render(values)
    decode, spot = rendered.groups[1:]
    assert (decode["minReplicas"], decode["replicas"], decode["maxReplicas"]) == (2, 3, 5)
    limits = _container(decode)["resources"]["limits"]
    assert limits == {"cpu": "16", "memory": "200Gi", "amd.com/gpu": "2"}
    assert "CPU" not in decode["resources"]  # an explicit cpu: Ray sees all of it
    assert decode["resources"]["fast_disk"] == "1" and decode["rayStartParams"]["object-store-memory"] == "1000000000"
    assert decode["template"]["spec"]["nodeSelector"] == {"pool": "decode"}
    assert spot["groupName"] == "decode-spot" and spot["resources"]["pdserve_decode"] == "1"
    assert (spot["minReplicas"], spot["replicas"], spot["maxReplicas"]) == (0, 0, 2)


@pytest.mark.parametrize("release", ["pds", "a-release-name-that-is-much-longer-than-kuberay-allows-for-a-service"])
def test_names_fit_kuberay(render, release):
    rendered = render({}, name=release)
    name = rendered.rayservice["metadata"]["name"]
    assert len(name) <= MAX_RAYSERVICE_NAME and not name.endswith("-")
    assert rendered.rayservice["metadata"]["annotations"]["ray.io/initializing-timeout"] == "30m"
    assert "serviceUnhealthySecondThreshold" not in rendered.rayservice["spec"]


@pytest.mark.parametrize("case", ["defaults", *EXAMPLES])
def test_min_replicas_never_exceed_max(render, case):
    for group in render(example_values(case) if case != "defaults" else {}).groups:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.mark.parametrize("values, message", [
    ({"pools": {"decode": {"minReplicas": 3, "maxReplicas": 2}}}, 'worker group "decode": minReplicas 3 exceeds maxReplicas 2'),
    ({"pools": {"decode": {"rayStartParams": {"num-cpus": "4"}}}}, "rayStartParams.num-cpus conflicts"),
    ({"extraWorkerGroups": [{"name": "decode", "pool": "decode"}]}, 'worker group name "decode" is used twice'),
    ({"config": "mode: colocated", "extraWorkerGroups": [{"name": "p2", "pool": "prefill"}]},
     'worker group "p2" is for pool "prefill", which config.mode colocated does not run'),
    ({"config": "prefill: {engine: {tensor_parallel_size: 4}}\ndecode: {engine: {tensor_parallel_size: 2}}"},
     "prefill tensor_parallel_size 4 with decode tensor_parallel_size 2"),
    ({"fullnameOverride": "1st-pdserve"}, "must start with a letter"),
])
def test_the_templates_reject_what_the_schema_cannot_see(helm, render, values, message):
    with pytest.raises(helm.HelmError, match=message.replace("(", r"\(").replace(")", r"\)")):
        render(values)


def _fingerprinted(rayservice: dict) -> dict:
    """rayClusterConfig as KubeRay hashes it to decide on a new cluster
    (GenerateHashWithoutReplicasAndWorkersToDelete): without replica counts, tolerations, upgradeStrategy."""
    spec = copy.deepcopy(rayservice["spec"]["rayClusterConfig"])
    spec.pop("upgradeStrategy", None)
    spec["headGroupSpec"]["template"]["spec"].pop("tolerations", None)
    for group in spec["workerGroupSpecs"]:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group["template"]["spec"].pop("tolerations", None)
    return spec


def test_a_chart_version_bump_keeps_the_cluster(helm, render, tmp_path):
    bumped = tmp_path / "pdserve"
    shutil.copytree(CHART, bumped)
    meta = yaml.safe_load((bumped / "Chart.yaml").read_text())
    (bumped / "Chart.yaml").write_text(yaml.safe_dump({**meta, "version": "9.9.9"}))
    with helm.Chart.load(bumped) as chart:
        after = yaml.safe_load(chart.render({}, name="pds", namespace="serving")["pdserve/templates/rayservice.yaml"])
    before = render().rayservice
    assert after["metadata"]["labels"]["helm.sh/chart"] == "pdserve-9.9.9"  # the object says which chart made it
    assert after["spec"]["rayClusterConfig"] == before["spec"]["rayClusterConfig"]  # the cluster does not


def test_scaling_and_tolerations_keep_the_cluster(render):
    before = render(example_values("llama3-8b-h100-a100.yaml"))
    after = render({**example_values("llama3-8b-h100-a100.yaml"),
                    "pools": {"prefill": {"replicas": 3, "maxReplicas": 8},
                              "decode": {"minReplicas": 0, "tolerations": [{"key": "gpu", "operator": "Exists"}]}},
                    "head": {"tolerations": [{"key": "cpu-only", "operator": "Exists"}]}})
    assert after.groups[0]["replicas"] == 3 and after.groups[1]["template"]["spec"]["tolerations"]
    assert _fingerprinted(after.rayservice) == _fingerprinted(before.rayservice)


def test_a_new_group_goes_at_the_end(render):
    before = render().groups
    after = render({"extraWorkerGroups": [{"name": "decode-more", "pool": "decode", "maxReplicas": 2}]}).groups
    assert after[:len(before)] == before and after[-1]["groupName"] == "decode-more"


def test_pod_templates_carry_no_release_specific_labels(render):
    spec = render().rayservice["spec"]["rayClusterConfig"]
    for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]:
        labels = template["metadata"]["labels"]
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels
        assert "checksum" not in str(template["metadata"].get("annotations", {}))


def test_ray_starts_its_workers_at_nice_0_unless_told_otherwise(render):
    def niceness(values: dict) -> list:
        spec = render(values).rayservice["spec"]["rayClusterConfig"]
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        return [{e["name"]: e.get("value") for e in _container(g).get("env", [])}.get("RAY_worker_niceness")
                for g in groups]

    assert niceness({}) == ["0", "0", "0"]  # head, prefill, decode: replicas as Ray's daemons, not at 15
    assert niceness({"rayWorkerNiceness": 5, "env": [{"name": "HF_HOME", "value": "/m"}]}) == ["5", "5", "5"]
    assert niceness({"rayWorkerNiceness": None}) == [None, None, None]  # Ray's own default
