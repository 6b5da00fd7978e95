"""Every relative link in the README and docs/ points at a file of the repository (and, with an
anchor, at a heading of it): the README is short and sends readers to these pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue                      # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_the_readme_is_short_and_links_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 120, "README.md is for a newcomer: move detail into docs/"
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md links no section for {missing}"
