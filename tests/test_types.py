"""mypy finds no type error in the tree, with the settings pyproject.toml's [tool.mypy] names: every package at
mypy's default, strict on the ground floor, the planner and the gateway, with Django's and DRF's stubs
(docs/testing.md). Marked `integration`: mypy is a program of its own, run as one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def test_mypy_finds_nothing(tmp_path):
    # Its cache of the test's own: a stale one never answers for this tree. PYTHONPATH: the Django plugin sets
    # the project up from this tree, not from another checkout the environment was installed from.
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--no-error-summary"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stdout + done.stderr
