"""docs/configuration.md is what its generator writes from platform/config.py today."""

from __future__ import annotations

import runpy
from pathlib import Path

DOCS = Path(__file__).parents[2] / "docs"


def test_the_configuration_reference_is_up_to_date():
    generator = runpy.run_path(str(DOCS / "gen_configuration.py"))
    assert (DOCS / "configuration.md").read_text() == generator["render"](), \
        "docs/configuration.md is stale: run python docs/gen_configuration.py"
