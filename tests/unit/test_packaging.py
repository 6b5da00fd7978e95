"""The package maps onto platform/ without shadowing the standard library's `platform`."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_platform_init():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_every_subfolder_is_packaged():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"pdserve": "platform"}
    folders = {"pdserve"} | {
        "pdserve." + ".".join(p.relative_to(ROOT / "platform").parts)
        for p in (ROOT / "platform").rglob("*") if p.is_dir() and any(p.glob("*.py"))}
    assert folders == set(cfg["packages"])


def test_stdlib_platform_still_wins_from_repo_root():
    out = subprocess.run([sys.executable, "-c", "import platform, pdserve; print(platform.system())"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}
