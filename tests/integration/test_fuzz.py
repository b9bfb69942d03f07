"""The REST API against its own OpenAPI schema: schemathesis, on a llmgw of its own (web, worker, beat), every
operation but the system restart (it restarts the processes under test).

It fails on any 5xx, any response the schema does not describe (status, body, content type), any request the
schema refuses that the API takes, and any request the schema allows that the API refuses other than as the
schema documents it: 404 for a path naming nothing, 409 for a conflict with the cluster's state, 422 for a
reason the schema cannot express (cluster/api/errors.py). Twice: with a fixed seed, then a random one, printed
so a failure can be replayed: `LLMGW_FUZZ_SEED=N` runs seed N in place of the random one.
"""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import start_system

pytestmark = pytest.mark.integration

ST = Path(sys.executable).with_name("st")
CONFIG = """\
[checks.positive_data_acceptance]
# the refusals the schema documents for what it cannot express (cluster/api/errors.py)
expected-statuses = ["2xx", "401", "403", "404", "409", "422"]
"""
EXAMPLES = 10  # per operation and phase: about 1,100 requests a run (the rollout endpoints too), under a minute
EXCLUDED_CHECKS = (
    # a model removed is `removing` (202) until its replicas have stopped, and found until then
    "use_after_free",
    # one tenant: every admin sees every object
    "object_level_authorization",
)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    # Redis db 4, not the other integration tests' 3; the fuzzer's own wrong tokens (ignored_auth) must not
    # shut the door on the right one it sends next (cluster/throttle.py)
    system = start_system(tmp_path_factory.mktemp("llmgw-fuzz"), extra_env={"LLMGW_AUTH_FREE_FAILURES": "1000000"},
                          redis_db=4)
    try:
        yield system
    finally:
        system.stop()


def fuzz(system, tmp_path: Path, seed: int) -> str:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    argv = [
        str(ST), "--config-file", str(config), "run", f"{system.url}/api/v1/schema/",
        "-H", f"Authorization: Bearer {system.admin_token}",
        "--checks", "all", "--exclude-checks", ",".join(EXCLUDED_CHECKS),
        "--exclude-path-regex", "system/restart",
        # one worker: hypothesis parses its lambdas' source with `ast`, which CPython 3.11 cannot do on two
        # threads at once ("AST constructor recursion depth mismatch")
        "--max-examples", str(EXAMPLES), "--seed", str(seed), "--workers", "1",
        "--generation-database", "none", "--no-color",
    ]
    env = {**os.environ, "NO_COLOR": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    said = done.stdout + done.stderr
    figures = re.search(r"(\d+) generated, .*", said)
    print(f"schemathesis seed {seed}: {figures.group(0) if figures else 'no figures'}")
    assert done.returncode == 0, f"schemathesis found failures with --seed {seed}:\n{said[-20000:]}"
    return said


def test_the_api_is_what_its_schema_says(fuzzed, tmp_path):
    said = fuzz(fuzzed, tmp_path, seed=1)
    counts = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", said)
    assert counts and int(counts[3]) == int(counts[1]) == int(counts[2]) - 1, said[-3000:]  # every operation but one
    seed = int(os.environ.get("LLMGW_FUZZ_SEED") or random.SystemRandom().randrange(2**31))
    print(f"and seed {seed} (replay it: LLMGW_FUZZ_SEED={seed})")
    fuzz(fuzzed, tmp_path, seed=seed)
    assert "Traceback" not in fuzzed.procs["web"].tail(5000), fuzzed.procs["web"].tail(200)
