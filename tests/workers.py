"""The suite runs on several pytest-xdist workers (conftest.py says how the tests are shared out); what each worker
must have of its own is told apart by its number."""

import os


def worker_index() -> int:
    """This worker's number: 0 for the first worker, or for a run without workers (`-n 0`)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
