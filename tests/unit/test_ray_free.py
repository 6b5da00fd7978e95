"""The unit tier imports no Ray (docs/testing.md): in a fresh interpreter where `import ray`
raises, every import statement of the tier's files that names pdserve, the tests' own modules
or Ray runs, those inside functions too. That loads every unit test's helpers and every pdserve
module they reach, and each module those import on loading. (tests/unit/conftest.py fails a test
that imports Ray while it runs; tests/unit/test_layering.py keeps Ray out of the pure modules.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The unit tier's files: its tests and conftests, and the session-wide conftest they run under.
FILES = [ROOT / "tests" / "conftest.py", *sorted((ROOT / "tests" / "unit").rglob("*.py"))]
OTHER_TIERS_FIXTURES = {"ray_session"}  # tests/conftest.py's, for integration and e2e
CANARY = "import ray"  # must fail there, or the check checks nothing

CHECK = """
import sys
sys.modules["ray"] = None  # `import ray` and `from ray.x import y` now raise ImportError
failed = []
for where, statement in [line.split("\\t") for line in sys.stdin.read().splitlines()]:
    try:
        exec(statement, {})
    except ImportError as e:
        failed.append(f"{where}: {statement}: {e}")
print("\\n".join(failed))
"""


def _names_ray_or_ours(node: ast.Import | ast.ImportFrom) -> bool:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return any(n.split(".")[0] in ("ray", "pdserve", "tests") for n in names)


def _statements(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if not (isinstance(child, ast.FunctionDef) and child.name in OTHER_TIERS_FIXTURES):
            yield child
            yield from _statements(child)


def _import_statements() -> list[tuple[str, str]]:
    found = []
    for path in FILES:
        for node in _statements(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0) \
                    and _names_ray_or_ours(node):
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", ast.unparse(node)))
    return found


def test_the_unit_tiers_imports_load_without_ray():
    statements = _import_statements()
    assert len(statements) > 100  # the walk found the tier
    lines = "\n".join(f"{where}\t{s}" for where, s in [*statements, ("canary", CANARY)])
    out = subprocess.run([sys.executable, "-c", CHECK], input=lines, cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    failed = out.stdout.strip().splitlines()
    assert failed and failed[-1].startswith(f"canary: {CANARY}:"), out.stdout
    wrong = failed[:-1]
    assert wrong == [], "unit-tier imports that need Ray (move the test to tests/integration):\n" + "\n".join(wrong)
