"""The `llmgw` distribution and program: its dependency ranges hold the pins, where an installation is found from
any directory, and the program's one-line answers where there is nothing to work on. (tests/integration/
test_package.py builds the wheel and installs it.)"""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import psutil
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from llmgw import home as home_module
from llmgw.home import home, secret_key

ROOT = Path(__file__).resolve().parents[1]
LLMGW = Path(sys.executable).parent / "llmgw"  # bin/setup-venv installs the checkout (editable)


def pins(name: str = "base.txt") -> dict[str, str]:
    found = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            found[requirement.name.lower()] = str(requirement.specifier).removeprefix("==")
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["server"], *extras["xllamacpp"]]]


def test_every_dependency_of_the_package_is_pinned_and_its_range_holds_the_pin():
    pinned = pins()
    for requirement in declared():
        name = requirement.name.lower()
        assert name in pinned, f"{name} is a dependency of the package but not pinned in requirements/base.txt"
        assert requirement.specifier.contains(pinned[name], prereleases=True), \
            f"{requirement} does not hold the pin {name}=={pinned[name]}"


def test_the_lock_holds_every_pin_at_its_version_and_pins_exact_versions_only():
    locked = {canonicalize_name(package): version for package, version in pins("lock.txt").items()}
    for name in ("base.txt", "dev.txt"):
        for package, version in pins(name).items():
            found = locked.get(canonicalize_name(package))
            assert found == version, f"requirements/{name} pins {package}=={version}; lock.txt has {found}"
    assert "kombu" in locked  # what celery pulls in
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[^\s;#]+", line), f"lock.txt: {line!r} is not name==version"


def test_every_pin_is_a_dependency_of_the_package():
    names = {r.name.lower() for r in declared()}
    # psycopg-binary is psycopg[binary]'s; pinned for the reproducible install
    assert set(pins()) - names == {"psycopg-binary"}


def run(*args, env=None, cwd="/") -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_SETTINGS", "LLMGW_"))}
    return subprocess.run([str(LLMGW), *args], env={**base, **(env or {})}, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_the_checkout_is_one_installation_from_any_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMGW_HOME", raising=False)
    assert home() == ROOT / ".llmgw"
    monkeypatch.chdir(tmp_path)
    assert home() == ROOT / ".llmgw"
    monkeypatch.setenv("LLMGW_HOME", str(tmp_path / "elsewhere"))
    assert home() == tmp_path / "elsewhere"


def test_an_installed_llmgw_keeps_its_state_in_the_users_data_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMGW_HOME", raising=False)
    monkeypatch.setattr(home_module, "CHECKOUT", None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert home() == tmp_path / ".local" / "share" / "llmgw"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert home() == tmp_path / "data" / "llmgw"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert home() == Path("/var/lib/llmgw")


@pytest.mark.integration  # runs the program
def test_a_command_where_nothing_is_installed_says_where_it_looked_and_makes_nothing(tmp_path):
    nothing = tmp_path / "nothing"
    for command in (("ctl", "models"), ("status",), ("node", "list")):
        said = run(*command, env={"LLMGW_HOME": str(nothing), "DATABASE_URL": ""})
        assert said.returncode == 1
        assert said.stderr == (f"error: no llmgw installation at {nothing} (LLMGW_HOME): start one there with "
                               f"`llmgw up`, point LLMGW_HOME (or DATABASE_URL) at yours, or talk to a server: "
                               f"`llmgw login URL`\n")
    assert not nothing.exists()


def test_the_secret_key_is_made_once_and_kept(tmp_path):
    assert secret_key(tmp_path / "absent") != secret_key(tmp_path / "absent")  # nothing installed: nothing kept
    assert not (tmp_path / "absent").exists()
    first = secret_key(tmp_path)
    assert secret_key(tmp_path) == first == (tmp_path / "secret-key").read_text()
    assert (tmp_path / "secret-key").stat().st_mode & 0o077 == 0
    assert [p.name for p in tmp_path.iterdir()] == ["secret-key"]  # no temporary file left


@pytest.mark.integration  # runs the program
@pytest.mark.parametrize("args, env, said", [
    ((), {}, "error: the agent needs the control plane's URL: --server URL\n"),
    (("--server", "http://127.0.0.1:9"), {},
     "error: the agent needs its node token: LLMGW_AGENT_TOKEN or --token-file PATH (`llmgw node add` prints it)\n"),
    (("--server", "http://127.0.0.1:9", "--token-file", "/nonexistent/token"), {},
     "error: cannot read --token-file /nonexistent/token: No such file or directory\n"),
    (("--server", "ftp://x"), {"LLMGW_AGENT_TOKEN": "lnt_x"}, None),
    (("--server", "http://127.0.0.1:9", "--memory", "lots"), {"LLMGW_AGENT_TOKEN": "lnt_x"}, None),
    (("--server", "http://127.0.0.1:9"), {"LLMGW_AGENT_TOKEN": "lnt_x", "LLMGW_AGENT_REPORT_INTERVAL": "soon"},
     "error: LLMGW_AGENT_REPORT_INTERVAL must be a whole number of seconds, not 'soon'\n"),
    (("--bogus",), {}, None),
    (("--server", "http://127.0.0.1:9,127.0.0.1:10"), {"LLMGW_AGENT_TOKEN": "lnt_x"},
     "error: not a server URL: '127.0.0.1:10' (write e.g. https://llmgw.example.com)\n"),
    (("--server", "http://127.0.0.1:9", "--advertise-address", "10.0.0.1:80"), {"LLMGW_AGENT_TOKEN": "lnt_x"},
     "error: --advertise-address '10.0.0.1:80' is not an IP address or host name\n"),
    (("stop-engines", "--state-dir", "/nonexistent/agent"), {},
     "error: no agent state in /nonexistent/agent: nothing was recorded there (--state-dir DIR)\n"),
    (("--server", "http://127.0.0.1:9", "--state-dir", "/proc/llmgw-agent"), {"LLMGW_AGENT_TOKEN": "lnt_x"},
     "error: No such file or directory (/proc/llmgw-agent)\n"),
])
def test_the_agents_bad_input_is_one_line(args, env, said):
    done = run("agent", *args, env={**env, "LLMGW_LOG_LEVEL": "WARNING"})  # its start-up line aside
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    if said:
        assert done.stderr == said


@pytest.mark.integration  # runs the program
def test_a_token_where_others_can_read_it_is_warned_about(tmp_path):
    token = tmp_path / "token"
    token.write_text("lnt_x\n")
    token.chmod(0o644)
    done = run("agent", "--server", "http://127.0.0.1:9", "--token-file", str(token), "--memory", "lots")
    assert f"warning: {token} can be read by other users; chmod 600 it\n" in done.stderr
    done = run("agent", "--server", "http://127.0.0.1:9", "--token", "lnt_x", "--memory", "lots")
    assert "warning: a token on the command line is visible to every user of this machine in `ps`" in done.stderr


@pytest.mark.integration  # runs the program
def test_stop_engines_stops_what_a_hand_started_agent_recorded(tmp_path):
    """An engine outlives its agent by design: `llmgw agent stop-engines` stops the ones it recorded, and keeps
    their records for the next agent to report them stopped."""
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        records = tmp_path / "engines"
        records.mkdir()
        (records / "m-1.json").write_text(
            f'{{"name": "m-1", "pid": {engine.pid}, "create_time": {psutil.Process(engine.pid).create_time()}}}')
        done = run("agent", "stop-engines", "--state-dir", str(tmp_path))
        assert (done.returncode, done.stdout) == (0, f"stopped 1 engine(s): m-1 (recorded in {tmp_path})\n")
        assert engine.wait(10) is not None
        assert not list(records.iterdir()) and (tmp_path / "stopped" / "m-1.json").exists()
    finally:
        engine.kill()
        engine.wait()


def completes(script: str, *words: str) -> list[str]:
    """What bash offers for the last of `words` with the completion script loaded."""
    array = " ".join(f"'{w}'" for w in ("llmgw", *words))
    done = subprocess.run(["bash", "-c", f'source /dev/stdin; COMP_WORDS=({array}); COMP_CWORD={len(words)}; '
                                         f'_shtab_llmgw; echo "${{COMPREPLY[@]}}"'],
                          input=script, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.integration  # runs the program
def test_shell_completion_comes_from_the_command_tree_itself():
    bash = run("completion", "bash")
    assert bash.returncode == 0
    assert completes(bash.stdout, "ct") == ["ctl"]
    assert completes(bash.stdout, "ctl", "model", "a") == ["add"]
    assert set(completes(bash.stdout, "ctl", "model", "set", "m", "--rout")) == {"--routing"}
    assert completes(bash.stdout, "agent", "--token") == ["--token-file", "--token"]
    zsh = run("completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef llmgw")
    wrong = run("completion", "fish")
    assert (wrong.returncode, wrong.stderr.count("\n")) == (1, 1) and "invalid choice: 'fish'" in wrong.stderr


@pytest.mark.integration  # runs the program
def test_the_program_says_its_own_version():
    from ground.facts import AGENT_VERSION  # the distribution's version (pyproject.toml reads it there)

    said = run("--version")
    assert (said.returncode, said.stdout) == (0, f"llmgw {AGENT_VERSION}\n")


@pytest.mark.integration  # runs the program
def test_the_program_runs_from_a_directory_holding_modules_named_as_its_own(tmp_path):
    """Python puts the directory a program runs from on its import path (Celery's Django fix-up puts it first):
    a project's `agents.py` there must not take the place of llmgw's own package."""
    here = tmp_path / "project"
    here.mkdir()
    for name in ("agents", "cluster", "gateway", "dashboard", "ground"):
        (here / f"{name}.py").write_text(f"raise SystemExit('the directory\\'s {name}.py was imported')\n")
    nothing = tmp_path / "nothing"
    env = {"LLMGW_HOME": str(nothing), "DATABASE_URL": ""}
    said = run("status", env=env, cwd=here)
    assert said.stderr.startswith(f"error: no llmgw installation at {nothing}"), said.stderr
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_SETTINGS", "LLMGW_"))}
    for argv in ([sys.executable, "-m", "llmgw", "status"], [sys.executable, "-m", "celery", "-A", "llmgw", "report"]):
        said = subprocess.run(argv, env={**base, **env}, cwd=here, capture_output=True, text=True, timeout=120)
        assert "was imported" not in said.stdout + said.stderr, (argv, said.stdout[-2000:], said.stderr[-2000:])
    said = subprocess.run([sys.executable, "-m", "celery", "-A", "llmgw", "report"], env={**base, **env}, cwd=here,
                          capture_output=True, text=True, timeout=120)
    assert said.returncode == 0 and "llmgw" in said.stdout, said.stderr[-2000:]
