"""Fixtures for the chart tests: the chart loaded once into the Helm engine (helm-python-sdk, Helm's
Go SDK in-process, no helm binary), a renderer that returns parsed objects, and the KubeRay CRDs
vendored under tests/helm/crds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).parents[2]
CHART = REPO / "deploy" / "helm" / "pdserve"
CONFIGS = REPO / "configs"
CRDS = Path(__file__).parent / "crds"  # KubeRay v1.7.0's, vendored (crds/SOURCE.md)
EXAMPLES = sorted(p.name for p in CONFIGS.glob("*.yaml"))
RELEASE, NAMESPACE = "pds", "serving"


@dataclass
class Rendered:
    """One render: every object by (kind, name), and NOTES.txt."""

    objects: dict[tuple[str, str], dict]
    notes: str

    def one(self, kind: str) -> dict:
        [obj] = [o for (k, _), o in self.objects.items() if k == kind]
        return obj

    def all(self, kind: str) -> list[dict]:
        return [o for (k, _), o in self.objects.items() if k == kind]

    @property
    def stable_objects(self) -> dict[tuple[str, str], dict]:
        """The objects less the chart's one random value (a new Redis password's Secret data, which
        `helm template` cannot read back from a cluster)."""
        return {key: ({**obj, "data": "<random>"} if key[0] == "Secret" and key[1].endswith("-redis") else obj)
                for key, obj in self.objects.items()}

    @property
    def rayservice(self) -> dict:
        return self.one("RayService")

    @property
    def serve_config(self) -> dict:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def groups(self) -> list[dict]:
        return self.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]


@pytest.fixture(scope="session")
def helm():
    return pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the dev extra) for chart tests")


@pytest.fixture(scope="session")
def chart(helm):
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart):
    def _render(values: dict[str, Any] | None = None, name: str = RELEASE) -> Rendered:
        manifests = chart.render(values or {}, name=name, namespace=NAMESPACE)
        objects, notes = {}, ""
        for path, text in manifests.items():
            if path.endswith("NOTES.txt"):
                notes = text
                continue
            for obj in yaml.safe_load_all(text):
                if obj:
                    objects[(obj["kind"], obj["metadata"]["name"])] = obj
        return Rendered(objects, notes)
    return _render


def example_values(name: str) -> dict[str, Any]:
    """An example config as `helm install --set-file config=configs/NAME` passes it: as text."""
    return {"config": (CONFIGS / name).read_text()}


@pytest.fixture(scope="session")
def rayservice_validator():
    from tests.helm.kube_schemas import crd_validator

    return crd_validator(CRDS / "ray.io_rayservices.yaml")
