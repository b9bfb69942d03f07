"""The tree is clean for ruff, with the rules pyproject.toml names and says why (docs/testing.md). Marked
`integration`: ruff is a program of its own, run as one (the fast set leaves it to `ruff check .`)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
