"""`pdserve config validate` as a command: its exit status says whether every file was valid.
(What it reports: tests/unit/test_config_check.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).parents[2] / "configs"


def test_the_command_exit_status(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: {num_replicas: -1}\n")
    run = lambda *files: subprocess.run([sys.executable, "-m", "pdserve.cli", "config", "validate", *files],
                                        capture_output=True, text=True)
    ok = run(str(CONFIGS / "tiny-cpu.yaml"))
    assert ok.returncode == 0 and "tiny-cpu.yaml: valid" in ok.stdout
    failed = run(str(CONFIGS / "tiny-cpu.yaml"), str(bad), str(tmp_path / "missing.yaml"))
    assert failed.returncode == 1
    assert "bad.yaml: 1 problem\n  decode.num_replicas: Input should be greater than or equal to 1 (got -1)" in failed.stderr
    assert "missing.yaml: cannot read it" in failed.stderr
