"""`llmgw service`: this machine's llmgw systemd units — llmgw-web, llmgw-worker, llmgw-beat, llmgw-agent.

`service install` writes the units; `start` starts them in dependency order (web, worker, beat, agent), `stop`
stops them in reverse, `restart` both, `status` asks systemd. Only `systemctl` (LLMGW_SYSTEMCTL) is run, from
`systemctl()` below; the tests stand a recording script in for it there.

The agent unit has `KillMode=process`: stopping it stops the agent, not the engines it started (they keep
serving, and the next agent adopts them), unless `service stop agent --engines`.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError

from agents.agent.records import stop_recorded_engines
from llmgw.home import secret_key
from llmgw.web import web_argv

ORDER = ("web", "worker", "beat", "agent")
ROLES = {"control": ("web", "worker", "beat"), "agent": ("agent",), "all": ORDER}
DESCRIPTIONS = {
    "web": "llmgw web: dashboard, REST API, gateway /v1/, agent streams",
    "worker": "llmgw Celery worker: reconciles, drains, restarts",
    "beat": "llmgw Celery beat: the reconciler's clock",
    "agent": "llmgw agent: starts and watches this machine's engines",
}


def unit_name(part: str) -> str:
    return f"llmgw-{part}.service"


def systemctl(*args: str) -> subprocess.CompletedProcess:
    """The one place llmgw runs systemctl."""
    try:
        return subprocess.run([settings.LLMGW_SYSTEMCTL, *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise CommandError(f"{settings.LLMGW_SYSTEMCTL} not found: `service` needs Linux with systemd") from None


def _require_systemd() -> None:
    if not sys.platform.startswith("linux") or not Path(settings.LLMGW_SYSTEMD_RUNTIME).is_dir():
        raise CommandError("this machine does not run systemd: `llmgw service` manages systemd units (use `llmgw up` instead)")


def _require_root() -> None:
    if os.geteuid() != 0:
        raise CommandError("starting and stopping services needs root: run it with sudo")


def installed() -> list[str]:
    unit_dir = Path(settings.LLMGW_SYSTEMD_DIR)
    return [part for part in ORDER if (unit_dir / unit_name(part)).exists()]


def _parts(asked: list[str]) -> list[str]:
    unknown = [p for p in asked if p not in ORDER]
    if unknown:
        raise CommandError(f"no such part: {', '.join(unknown)} (choose from {', '.join(ORDER)})")
    here = installed()
    if not here:
        raise CommandError(f"no llmgw unit is installed in {settings.LLMGW_SYSTEMD_DIR}: run `llmgw service install` first")
    missing = [p for p in asked if p not in here]
    if missing:
        raise CommandError(f"not installed here: {', '.join(missing)} (installed: {', '.join(here)})")
    return [p for p in ORDER if p in (asked or here)]


def service(o, out) -> None:
    _require_systemd()
    action = o["action"]
    if action == "install":
        return install(o, out)
    if action != "status":
        _require_root()
    parts = _parts(o.get("parts") or [])
    if action == "status":
        for part in parts:
            state = systemctl("is-active", unit_name(part)).stdout.strip() or "unknown"
            enabled = systemctl("is-enabled", unit_name(part)).stdout.strip() or "unknown"
            out.write(f"{unit_name(part):22} {state:10} {enabled}\n")
        return
    if action in ("stop", "restart"):
        for part in reversed(parts):
            _run(out, "stop", part)
        if "agent" in parts:
            if o.get("engines"):
                n = len(stop_recorded_engines(Path(settings.LLMGW_HOME) / "agent",
                                              why="stopped with `llmgw service stop --engines`"))
                out.write(f"stopped {n} engine(s) (--engines)\n")
            elif action == "stop":
                out.write("the agent's engines keep serving (the next agent adopts them); --engines stops them too\n")
    if action in ("start", "restart"):
        for part in parts:
            _run(out, "start", part)


def _run(out, verb: str, part: str) -> None:
    done = systemctl(verb, unit_name(part))
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-1:] or "?"
        raise CommandError(f"systemctl {verb} {unit_name(part)} failed: {said}")
    out.write(f"{verb} {unit_name(part)}: ok\n")


def install(o, out) -> None:
    _require_root()
    role = o["role"]
    workers = o.get("web_workers")
    if workers is not None and not 1 <= workers <= 64:
        raise CommandError(f"--web-workers must be between 1 and 64, not {workers}")
    if ":" in (o.get("host") or "") and (workers or 1) > 1:
        raise CommandError("--web-workers above 1 needs an IPv4 address to share (on IPv6 each web process binds its own)")
    o = {**o, "web_workers": workers or (1 if ":" in (o.get("host") or "") else os.cpu_count() or 1)}
    if role in ("agent", "all") and not o.get("server"):
        raise CommandError("the agent unit needs --server URL (the control plane the agent connects to)")
    unit_dir = Path(settings.LLMGW_SYSTEMD_DIR)
    unit_dir.mkdir(parents=True, exist_ok=True)
    user = o.get("user") or os.environ.get("SUDO_USER") or getpass.getuser()
    _make_home(Path(settings.LLMGW_HOME), user)
    written = []
    for part in ROLES[role]:
        path = unit_dir / unit_name(part)
        path.write_text(render(part, o, user))
        written.append(path.name)
    reload = systemctl("daemon-reload")
    if reload.returncode != 0:
        raise CommandError(f"systemctl daemon-reload failed: {reload.stderr.strip()}")
    enable = systemctl("enable", *written)
    if enable.returncode != 0:
        raise CommandError(f"systemctl enable failed: {enable.stderr.strip()}")
    out.write(f"wrote and enabled {', '.join(written)} in {unit_dir} (running as {user}); start them with: "
              f"sudo llmgw service start\n")


def _make_home(home: Path, user: str) -> None:
    """The units' LLMGW_HOME (their working directory) with its secret key, owned by the user they run as: every
    web process of the units then signs sessions with the same key."""
    try:
        home.mkdir(parents=True, exist_ok=True)
        secret_key(home)
        for path in (home, home / "secret-key"):
            shutil.chown(path, user)
    except LookupError:
        raise CommandError(f"no user {user} on this machine (--user)") from None
    except OSError as exc:
        raise CommandError(f"cannot make {home} for the units: {exc.strerror or exc}") from None


def render(part: str, o: dict, user: str) -> str:
    py = sys.executable
    home = Path(settings.LLMGW_HOME)
    if part == "web":
        host, port, workers = o.get("host") or "0.0.0.0", o.get("port") or 8000, o.get("web_workers") or 1
        if workers > 1:  # the unit's process holds the socket and runs the web processes on it (llmgw/web.py)
            argv = [py, "-m", "llmgw.web", "--host", host, "--port", str(port), "--workers", str(workers)]
            if o.get("web_server"):
                argv += ["--server", o["web_server"]]
        else:
            argv = web_argv(host, port, o.get("web_server"), python=py)
    elif part == "worker":
        argv = [py, "-m", "celery", "-A", "llmgw", "worker", "-l", "info", "--without-gossip", "--without-mingle"]
    elif part == "beat":
        argv = [py, "-m", "celery", "-A", "llmgw", "beat", "-l", "info", "-s", str(home / "run" / "celerybeat-schedule")]
    else:
        argv = [py, "-m", "llmgw", "agent", "--server", o["server"], "--state-dir", str(home / "agent")]
    after = {"web": "network-online.target", "worker": "network-online.target llmgw-web.service",
             "beat": "network-online.target llmgw-worker.service", "agent": "network-online.target llmgw-beat.service"}[part]
    lines = [
        "# written by `llmgw service install`; run it again rather than editing this file",
        "[Unit]",
        f"Description={DESCRIPTIONS[part]}",
        "Wants=network-online.target",
        f"After={after}",
        "",
        "[Service]",
        f"User={user}",
        f"WorkingDirectory={home}",
        f"Environment=LLMGW_HOME={home}",
        "Environment=PYTHONUNBUFFERED=1",
        "EnvironmentFile=-/etc/llmgw/env",  # DATABASE_URL, REDIS_URL, LLMGW_SECRET_KEY, LLMGW_AGENT_TOKEN, ...
        f"ExecStart={shlex.join(argv)}",
        "Restart=always",  # also how a process told to restart by `llmgw restart` comes back
        "RestartSec=2",
        "TimeoutStopSec=60",
    ]
    if part in ("web", "worker", "beat"):  # where the other control planes fetch its model files (cluster/mirror/);
        # /etc/llmgw/env may say otherwise (systemd: an EnvironmentFile's settings win)
        host = o.get("host") or "0.0.0.0"
        named = socket.getfqdn() if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
        lines.insert(lines.index("Environment=PYTHONUNBUFFERED=1"),
                     f"Environment=LLMGW_CONTROL_PLANE_URL=http://{named}:{o.get('port') or 8000}")
    if part == "web":  # a Host naming the address it binds is one it allows (settings.ALLOWED_HOSTS)
        lines.insert(lines.index("Environment=PYTHONUNBUFFERED=1"), f"Environment=LLMGW_BIND_HOST={o.get('host') or '0.0.0.0'}")
    if part == "agent":
        lines += ["# the engines outlive the agent; the next agent adopts them", "KillMode=process"]
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
