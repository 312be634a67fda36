"""Runs a test file's `on_cpu_interpreter` cases in a fresh process under the Triton interpreter:
TRITON_INTERPRET must be set before Triton is imported, so the default run cannot switch it on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreter_cases(test_file: str, expected_passed: int, markers: str | None = None) -> None:
    """`markers`: the run's -m expression (None: the project's default, which leaves out the `slow` cases)."""
    selection = [] if markers is None else ["-m", markers]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(test_file).resolve().relative_to(ROOT)), "-q",
         "-p", "no:cacheprovider", "-k", "on_cpu_interpreter", *selection],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{expected_passed} passed" in result.stdout, result.stdout[-2000:]
