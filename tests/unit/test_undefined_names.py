"""Every name the code uses is defined somewhere it can be reached (pyflakes), in the branches the
CPU suite never runs too: a GPU's, another platform's. A GPU-only branch once used names of
another function (copied there by an edit) and only a GPU run would have found it."""

from __future__ import annotations

import ast
from pathlib import Path

from pyflakes import checker, messages

ROOT = Path(__file__).resolve().parents[2]
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


def _undefined(path: Path) -> list[str]:
    found = checker.Checker(ast.parse(path.read_text(), str(path)), filename=str(path)).messages
    return [f"{path.relative_to(ROOT)}:{m.lineno}: {m.message % m.message_args}" for m in found
            if isinstance(m, UNDEFINED)]


def test_no_module_uses_an_undefined_name():
    paths = [p for folder in ("platform", "benchmarks", "tests") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(paths) > 100
    assert [line for p in paths for line in _undefined(p)] == []
