"""The wheel, as operators install it: built from the checkout, installed into fresh virtual environments.

- A node's install (`pip install llmgw`, no `[server]`) has no Django, Celery or database driver, lives beside
  `openai-agents` (which installs a top-level `agents` too), and its `llmgw agent` — started the way `node add`
  says, away from the checkout — serves a replica of the test control plane; `llmgw agent stop-engines` stops it.
- The control plane's install (`llmgw[server]`) runs `llmgw up` from an empty directory, and a command run from
  another directory finds that installation.
"""

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from agents.ports import free_port
from llmgw.processes import Child
from tests.integration.harness import ROOT, wait_for
from tests.test_package import completes

pytestmark = pytest.mark.integration

REQUIREMENTS = ROOT / "requirements"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(ROOT)], 600)
    [built] = out.glob("llmgw-*.whl")
    return built


def run(argv: list, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{shlex.join(map(str, argv))}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def clean_env(**extra: str) -> dict:
    """A user's shell: nothing of this test run, the checkout or its settings."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "PIP_CACHE_DIR", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL")
    return {**{k: v for k, v in os.environ.items() if k in keep}, **extra}


def venv(path: Path, *requirements: str) -> Path:
    """A fresh virtual environment with these installed, at the versions requirements/ pins where it pins them."""
    run([sys.executable, "-m", "venv", path])
    run([path / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--constraint", REQUIREMENTS / "base.txt", *requirements], 900, env=clean_env())
    return path


def test_a_node_runs_the_agent_from_the_wheel_beside_openai_agents(system, wheel, tmp_path):
    node_env = venv(tmp_path / "node", str(wheel), "openai-agents")
    python, llmgw = node_env / "bin" / "python", node_env / "bin" / "llmgw"
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()

    # the agent alone: no control plane, and a program that says what to install for one
    missing = run([python, "-c", "import importlib.util as u; print([m for m in ('django', 'celery', 'psycopg', "
                                 "'channels', 'rest_framework') if u.find_spec(m)])"], cwd=elsewhere)
    assert missing.stdout.strip() == "[]"
    up = subprocess.run([llmgw, "up"], capture_output=True, text=True, cwd=elsewhere, env=clean_env(), timeout=60)
    assert (up.returncode, up.stdout) == (1, "")
    assert up.stderr == ('error: `llmgw up`: the control plane is not installed here (only the agent is): '
                         'pip install "llmgw[server]"\n')

    # the node's program completes its own commands
    script = run([llmgw, "completion", "bash"], cwd=elsewhere, env=clean_env()).stdout
    assert completes(script, "ag") == ["agent"] and completes(script, "agent", "st") == ["stop-engines"]

    # openai-agents' `agents` is the one a program gets, and it works
    theirs = run([python, "-c", "from agents import Agent; import agents; "
                                "print(Agent(name='helper', instructions='be brief').name, agents.__file__)"],
                 cwd=elsewhere, env=clean_env())
    name, where = theirs.stdout.split()
    assert name == "helper" and "/site-packages/agents/" in where
    # … and ours is the one llmgw's processes get (each starts by importing llmgw)
    ours = run([python, "-c", "import llmgw; import agents.agent.program as p; print(p.__file__)"],
               cwd=elsewhere, env=clean_env())
    assert "/site-packages/llmgw/apps/agents/agent/program.py" in ours.stdout

    # `node add` says what to run on the node: run it so (the token from the environment, never argv)
    said = system.cli("node", "add", "wheelnode", "--server", system.url).stdout
    command = said.strip().splitlines()[-1].strip()
    assignment, program, *args = shlex.split(command)
    token = assignment.removeprefix("LLMGW_AGENT_TOKEN=")
    assert (program, args) == ("llmgw", ["agent", "--server", system.url]) and token.startswith("lnt_")
    state = tmp_path / "node-state"
    agent = Child("wheel-agent", [str(llmgw), *args, "--state-dir", str(state), "--memory", "1GiB", "--gpus", "none",
                                  "--port-range", "23800-23899", "--stop-timeout", "5"],
                  tmp_path / "wheel-agent.log", clean_env(LLMGW_AGENT_TOKEN=token), cwd=elsewhere).start()
    try:
        assert token not in " ".join(psutil.Process(agent.pid).cmdline())  # what every user sees in `ps`
        system.wait_nodes_connected(["wheelnode"])
        system.cli("ctl", "model", "add", "wheel-m", "--file", system.sha, "--engine", "testengine", "--replicas", "1",
                   "--memory", "100MiB", "--nodes", "wheelnode")
        [replica] = system.wait_ready("wheel-m", 1)
        assert replica["node"] == "wheelnode"
        key = system.cli("ctl", "keys", "create", "wheel-key").stdout.split()[-1]
        answer = openai.OpenAI(base_url=system.url + "/v1", api_key=key, max_retries=0, timeout=60).chat.completions \
            .with_raw_response.create(model="wheel-m", messages=[{"role": "user", "content": "hello"}])
        assert answer.headers["x-llmgw-replica"] == replica["name"]
        assert answer.parse().choices[0].message.content

        # a hand-started agent's engines outlive it by design; `agent stop-engines` stops them
        agent.stop()
        assert httpx.get(f"http://127.0.0.1:{replica['port']}/health", timeout=5).status_code == 200
        stopped = run([llmgw, "agent", "stop-engines", "--state-dir", state], cwd=elsewhere, env=clean_env())
        assert stopped.stdout == f"stopped 1 engine(s): {replica['name']} (recorded in {state})\n"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{replica['port']}/health", timeout=5)
    except BaseException:
        print(agent.tail(60))
        raise
    finally:
        agent.stop(signal.SIGKILL, 5)
        system.cli("ctl", "model", "remove", "wheel-m", check=False)
        system.cli("ctl", "keys", "revoke", "wheel-key", check=False)
        system.cli("node", "remove", "wheelnode", "--force", check=False)


def test_the_control_plane_from_the_wheel_runs_up_in_an_empty_directory(wheel, tmp_path):
    server_env = venv(tmp_path / "server", f"{wheel}[server]")
    llmgw = server_env / "bin" / "llmgw"
    empty, other, state = tmp_path / "empty", tmp_path / "other", tmp_path / "state"
    empty.mkdir()
    other.mkdir()
    env = clean_env(LLMGW_HOME=str(state))  # its own SQLite and embedded Valkey: nothing shared with the suite
    port = free_port()
    up = Child("wheel-up", [str(llmgw), "up", "--port", str(port), "--no-demo", "--web-workers", "1"],
               tmp_path / "up.log", env, cwd=empty).start()
    try:
        def local_node_connected():
            nodes = subprocess.run([llmgw, "ctl", "nodes", "--json"], capture_output=True, text=True, cwd=other,
                                   env=env, timeout=60)
            return nodes.returncode == 0 and '"connected"' in nodes.stdout
        wait_for(local_node_connected, 120, interval=1, what="the wheel's `llmgw up` and its local agent")
        assert httpx.get(f"http://127.0.0.1:{port}/login/", timeout=10).status_code == 200
        assert list(empty.iterdir()) == []  # everything in LLMGW_HOME, nothing where it was started
        assert {"db.sqlite3", "secret-key", "logs", "run"} <= {p.name for p in state.iterdir()}
        for log in ("web.log", "worker.log", "beat.log", "agent.log"):
            assert "Traceback" not in (state / "logs" / log).read_text(), log
    except BaseException:
        print(up.tail(60))
        raise
    finally:
        up.stop(signal.SIGTERM, 60)
    assert up.returncode == 0 and "llmgw stopped." in up.tail(5)
