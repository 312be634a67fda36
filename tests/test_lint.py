"""The tree passes ruff with the rules pyproject.toml selects (pyflakes, pycodestyle's errors, lines up to 120
characters): unused or undefined names, imports not at the top, bare excepts and the like fail the default test run,
not a later reader."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_passes_ruff():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
