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


def test_pure_modules_import_no_ray():
    pure = ["pdserve.engine.engine", "pdserve.engine.llm", "pdserve.engine.scheduler",
            "pdserve.engine.kv_cache", "pdserve.engine.sampler", "pdserve.config", "pdserve.engine.async_engine",
            "pdserve.kvtransfer", "pdserve.kvtransfer.protocol", "pdserve.bench.metrics", "pdserve.bench.workloads",
            "pdserve.output_channel"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in pure) + "print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
