"""The package maps onto platform/ without shadowing the standard library's `platform`."""

import subprocess
import sys
import tomllib
from fnmatch import fnmatch
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


def test_the_kernel_sources_are_packaged():
    """The CPU kernels compile from their C sources on first use: every source and header ships."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["pdserve.engine.kernels"]
    sources = [p.name for p in (ROOT / "platform" / "engine" / "kernels").iterdir() if p.suffix in (".c", ".h")]
    assert sources and all(any(fnmatch(name, pattern) for pattern in patterns) for name in sources)


def test_stdlib_platform_still_wins_from_repo_root():
    out = subprocess.run([sys.executable, "-c", "import platform, pdserve; print(platform.system())"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}
