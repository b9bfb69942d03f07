"""`python -m llmgw.web --workers N`, what the systemd unit runs for `service install --web-workers N`: N web
processes on one socket the launcher holds, each started again when it exits, and not one connection refused
meanwhile; SIGTERM stops them all."""

import os
import signal
import subprocess
import sys
import threading

import httpx
import psutil
import pytest

from ground.ports import free_port
from tests.integration.harness import MANAGE, ROOT, _redis_db, flush_redis, wait_for

pytestmark = pytest.mark.integration


def web_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(launcher.pid).children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "llmgw.web" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def test_web_workers_share_one_socket_and_come_back_without_refusing_a_connection(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_SETTINGS"))}
    env.update(LLMGW_HOME=str(tmp_path), DJANGO_SETTINGS_MODULE="llmgw.settings", PYTHONUNBUFFERED="1",
               DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
               REDIS_URL=_redis_db(os.environ["REDIS_URL"], 6), LLMGW_WEB_SERVER="uvicorn")
    flush_redis(env["REDIS_URL"])
    subprocess.run([sys.executable, str(MANAGE), "migrate", "-v", "0"], env=env, cwd=ROOT, check=True, timeout=300)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/models"
    log = open(tmp_path / "web.log", "wb")
    launcher = subprocess.Popen([sys.executable, "-m", "llmgw.web", "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", "2"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    outcomes: list[str] = []
    stop = threading.Event()

    def ask():
        # a new connection each time (a request on a kept-alive connection the stopping process closes at that
        # moment is the proxy's to retry, docs/gateway.md: "Behind a proxy"); no key: the gateway's own 401 says a web
        # process answered
        while not stop.is_set():
            try:
                outcomes.append(str(httpx.get(url, timeout=10, headers={"Connection": "close"}).status_code))
            except httpx.HTTPError as exc:
                outcomes.append(repr(exc))

    try:
        wait_for(lambda: len(web_processes(launcher)) == 2, 60, what="two web processes")

        def answers():
            try:
                return httpx.get(url, timeout=5).status_code == 401
            except httpx.HTTPError:
                return False

        wait_for(answers, 60, what="the gateway to answer")
        asker = threading.Thread(target=ask)
        asker.start()
        try:
            for _ in range(2):  # each in turn told to stop, as `llmgw restart` tells it: it comes back
                old = web_processes(launcher)
                old[0].send_signal(signal.SIGTERM)
                wait_for(lambda old=old: len(web_processes(launcher)) == 2 and old[0] not in web_processes(launcher), 60,
                         what="the web process to be started again")
                served = len(outcomes)
                wait_for(lambda served=served: len(outcomes) > served + 20, 30, what="answers from the new one too")
        finally:
            stop.set()
            asker.join(30)
        assert outcomes and set(outcomes) == {"401"}, [o for o in outcomes if o != "401"][:5]
        for web in web_processes(launcher):  # each serves the socket it inherited, not one of its own
            assert "--fd" in web.cmdline()
        started = web_processes(launcher)
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        finally:
            log.close()
    assert launcher.returncode == 0, (tmp_path / "web.log").read_text()[-3000:]
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
