"""`llmgw service`: units written, started in order and stopped in reverse, with a recording script standing in
for systemctl (LLMGW_SYSTEMCTL, the one place llmgw runs it)."""

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

pytestmark = pytest.mark.integration  # a recording script runs as systemctl for every call

ROOT = Path(__file__).resolve().parents[1]
FAKE = """#!/bin/sh
echo "$@" >> {log}
case "$1" in
  is-active) echo active ;;
  is-enabled) echo enabled ;;
  start) [ "$2" = "llmgw-beat.service" ] && [ -e {fail} ] && {{ echo "Job for llmgw-beat.service failed." >&2; exit 1; }} ;;
esac
exit 0
"""


@pytest.fixture
def systemd(tmp_path, settings):
    log = tmp_path / "systemctl.log"
    fake = tmp_path / "systemctl"
    fake.write_text(FAKE.format(log=log, fail=tmp_path / "fail"))
    fake.chmod(0o755)
    (tmp_path / "runtime").mkdir()
    settings.LLMGW_SYSTEMCTL = str(fake)
    settings.LLMGW_SYSTEMD_DIR = str(tmp_path / "units")
    settings.LLMGW_SYSTEMD_RUNTIME = str(tmp_path / "runtime")
    settings.LLMGW_HOME = tmp_path / "home"  # install makes it and hands it to the units' user

    class Systemd:
        units = tmp_path / "units"
        fail = tmp_path / "fail"

        @staticmethod
        def calls() -> list[str]:
            return log.read_text().splitlines() if log.exists() else []

    return Systemd


def cli(*args) -> str:
    out = io.StringIO()
    call_command("llmgw", "service", *args, stdout=out)
    return out.getvalue()


def test_install_writes_enables_and_orders_the_units(systemd):
    said = cli("install", "--role", "all", "--server", "http://ctl:8000", "--user", "nobody", "--port", "8100",
               "--web-workers", "1")
    assert "wrote and enabled llmgw-web.service, llmgw-worker.service, llmgw-beat.service, llmgw-agent.service" in said
    assert systemd.calls() == [
        "daemon-reload",
        "enable llmgw-web.service llmgw-worker.service llmgw-beat.service llmgw-agent.service",
    ]
    web = (systemd.units / "llmgw-web.service").read_text()
    assert "User=nobody" in web and "Restart=always" in web
    assert f"ExecStart={sys.executable} -m llmgw.web --host 0.0.0.0 --port 8100\n" in web
    worker = (systemd.units / "llmgw-worker.service").read_text()
    assert "After=network-online.target llmgw-web.service" in worker and "celery -A llmgw worker" in worker
    beat = (systemd.units / "llmgw-beat.service").read_text()
    assert "celery -A llmgw beat" in beat
    here = f"Environment=LLMGW_CONTROL_PLANE_URL=http://{socket.getfqdn()}:8100\n"  # where peers fetch its files
    assert here in web and here in worker and here in beat
    agent = (systemd.units / "llmgw-agent.service").read_text()
    assert "llmgw agent --server http://ctl:8000" in agent and "LLMGW_CONTROL_PLANE_URL" not in agent
    assert "\nKillMode=process\n" in agent  # stopping the agent leaves its engines serving
    for unit in systemd.units.iterdir():  # systemd takes no comment after a value
        assert all("#" not in line for line in unit.read_text().splitlines() if "=" in line and not line.startswith("#"))


def test_install_makes_the_home_the_units_share_owned_by_their_user(systemd, settings):
    """Every web process of the units signs sessions with one key: install makes LLMGW_HOME and the key in it,
    owned by the user the units run as; a user the machine does not have is a one-line error that writes nothing."""
    import pwd

    with pytest.raises(CommandError, match="no user no-such-llmgw-user on this machine"):
        cli("install", "--role", "control", "--user", "no-such-llmgw-user")
    assert not systemd.units.exists() or not list(systemd.units.iterdir())
    cli("install", "--role", "control", "--user", "nobody")
    nobody = pwd.getpwnam("nobody").pw_uid
    key = settings.LLMGW_HOME / "secret-key"
    assert key.stat().st_uid == settings.LLMGW_HOME.stat().st_uid == nobody
    assert key.stat().st_mode & 0o077 == 0 and len(key.read_text()) > 40
    assert f"WorkingDirectory={settings.LLMGW_HOME}\n" in (systemd.units / "llmgw-web.service").read_text()


def test_web_workers_run_on_one_socket_the_unit_holds(systemd):
    cli("install", "--role", "control", "--port", "8100", "--web-workers", "3")
    web = (systemd.units / "llmgw-web.service").read_text()
    assert f"ExecStart={sys.executable} -m llmgw.web --host 0.0.0.0 --port 8100 --workers 3\n" in web
    cli("install", "--role", "control")  # by default as many as the machine has CPUs
    web = (systemd.units / "llmgw-web.service").read_text()
    workers = os.cpu_count()
    assert (f"-m llmgw.web --host 0.0.0.0 --port 8000 --workers {workers}\n" in web if workers > 1
            else "-m llmgw.web --host 0.0.0.0 --port 8000\n" in web)


def test_start_in_dependency_order_stop_in_reverse(systemd):
    cli("install", "--role", "all", "--server", "http://ctl:8000")
    before = len(systemd.calls())
    assert cli("start").splitlines() == [f"start llmgw-{p}.service: ok" for p in ("web", "worker", "beat", "agent")]
    said = cli("stop")
    assert said.splitlines()[:4] == [f"stop llmgw-{p}.service: ok" for p in ("agent", "beat", "worker", "web")]
    assert "engines keep serving" in said
    assert cli("restart", "worker", "web").splitlines() == [
        "stop llmgw-worker.service: ok", "stop llmgw-web.service: ok",
        "start llmgw-web.service: ok", "start llmgw-worker.service: ok",
    ]
    assert systemd.calls()[before:][:4] == [f"start llmgw-{p}.service" for p in ("web", "worker", "beat", "agent")]


def test_status_asks_systemd(systemd):
    cli("install", "--role", "control")
    said = cli("status")
    assert "llmgw-web.service" in said and "active" in said and "enabled" in said
    assert "llmgw-agent.service" not in said


def test_stop_agent_with_engines_stops_them_too(systemd, tmp_path, settings):
    engine = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        records = Path(settings.LLMGW_HOME) / "agent" / "engines"
        records.mkdir(parents=True, exist_ok=True)
        # as the agent records it: with the process's start time, so a reused pid is never taken for it
        started = psutil.Process(engine.pid).create_time()
        (records / "r1.json").write_text(json.dumps({"name": "r1", "pid": engine.pid, "create_time": started}))
        cli("install", "--role", "agent", "--server", "http://ctl:8000")
        said = cli("stop", "agent", "--engines")
        assert "stopped 1 engine(s)" in said
        assert engine.wait(15) is not None
    finally:
        engine.kill()
        (Path(settings.LLMGW_HOME) / "agent" / "engines" / "r1.json").unlink(missing_ok=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (("start", "agent"), "not installed here: agent (installed: web, worker, beat)"),
        (("start", "gateway"), "no such part: gateway"),
        (("install", "--role", "agent"), "the agent unit needs --server URL"),
        (("install", "--web-workers", "0"), "--web-workers must be between 1 and 64, not 0"),
        (("install", "--host", "::", "--web-workers", "2"), "--web-workers above 1 needs an IPv4 address"),
    ],
)
def test_clear_errors(systemd, args, message):
    cli("install", "--role", "control")
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cli(*args)


def test_nothing_installed_and_a_failing_unit(systemd):
    with pytest.raises(CommandError, match="no llmgw unit is installed"):
        cli("start")
    cli("install", "--role", "control")
    systemd.fail.write_text("")
    with pytest.raises(CommandError, match="systemctl start llmgw-beat.service failed: .*Job for llmgw-beat.service failed"):
        cli("start")


def test_not_a_systemd_machine(systemd, settings, tmp_path):
    settings.LLMGW_SYSTEMD_RUNTIME = str(tmp_path / "absent")
    with pytest.raises(CommandError, match="does not run systemd"):
        cli("status")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_changing_anything_needs_root(systemd, tmp_path):
    cli("install", "--role", "control")
    for path in (tmp_path / "runtime", systemd.units, tmp_path, *tmp_path.parents):
        if (path.stat().st_mode & 0o005) != 0o005:
            path.chmod(path.stat().st_mode | 0o005)  # let the unprivileged user see the stand-in systemd
    groups = os.getgroups()
    os.setgroups([])
    os.setegid(65534)
    os.seteuid(65534)  # nobody, for these calls only
    try:
        for action in ("start", "stop", "restart"):
            with pytest.raises(CommandError, match="^starting and stopping services needs root: run it with sudo$"):
                cli(action)
        assert "llmgw-web.service" in cli("status")  # looking needs no root
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)
