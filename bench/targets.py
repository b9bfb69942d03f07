"""The gateway benchmark's targets besides llmgw's own web process: Debian's nginx and LiteLLM's proxy (each
installed when missing), their configurations, and a real llmgw instance set up from nothing; waiting for a
target to answer; the CPU its processes use; the processes left at the end."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from loadgen import MODEL

from llmgw.processes import Child
from tests.integration import harness

ROOT = Path(__file__).resolve().parent.parent
LITELLM_VERSION = "1.108.7"
RESULT_MARK = "BENCH-RESULT "


def say(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def strays() -> list[str]:
    """Our own processes still running (there should be none at the end)."""
    try:
        import psutil
    except ImportError:
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
        return [line.strip() for line in out.splitlines() if line.strip() and "ps -o" not in line]
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append(f"{child.pid} {' '.join(child.cmdline())[:120]}")
        except psutil.Error:
            pass
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (nginx's worker), 0 when unknown."""
    try:
        import psutil
    except ImportError:
        return 0.0
    total = 0.0
    try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def wait_ready(child: Child, port: int, key: str, timeout: float, path: str = "/v1/chat/completions") -> None:
    """Until a real request through `child` answers 200 (or the process dies, or the time is up)."""
    payload = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with code {child.returncode}:\n{child.tail(30)}")
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", data=payload, method="POST",
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                if response.status == 200 and b"choices" in response.read():
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:300]!r}"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise RuntimeError(f"{child.name} did not answer within {timeout:.0f}s ({last}):\n{child.tail(30)}")


def metrics_counts(port: int, token: str) -> tuple[int, int, int]:
    """What a llmgw web process has counted for the model so far, from its /metrics: (answers 200, prompt tokens,
    completion tokens)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if f'model="{MODEL}"' not in name:
            continue
        if name.startswith("llmgw_requests_total{") and 'status="200"' in name:
            found["ok"] = int(float(value))
        elif name.startswith("llmgw_tokens_total{"):
            found["prompt" if 'kind="prompt"' in name else "completion"] = int(float(value))
    return found.get("ok", 0), found.get("prompt", 0), found.get("completion", 0)


# --- what the targets need ------------------------------------------------------------------------------


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


def nginx_binary(install: bool) -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if found or not install:
        if not found:
            raise RuntimeError("nginx is not installed (run without --no-install, or apt-get install nginx)")
        return found
    if os.geteuid() != 0:
        raise RuntimeError("nginx is not installed and this is not root: apt-get install nginx first")
    say("installing Debian's nginx (apt-get install -y nginx)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Keep the package from starting its own nginx on port 80: a policy-rc.d that says no, for the install only.
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        made_policy = True
    try:
        result = run(["apt-get", "install", "-y", "--no-install-recommends", "nginx"], env=env)
        if result.returncode != 0:
            say("apt-get install failed; apt-get update, then again")
            run(["apt-get", "update"], env=env)
            result = run(["apt-get", "install", "-y", "--no-install-recommends", "nginx"], env=env)
        if result.returncode != 0:
            raise RuntimeError(f"apt-get install nginx failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)
    return shutil.which("nginx") or "/usr/sbin/nginx"


def litellm_venv(install: bool) -> Path:
    base = Path(os.environ.get("LLMGW_BENCH_CACHE") or Path.home() / ".cache" / "llmgw-bench")
    venv = base / f"litellm-{LITELLM_VERSION}"
    exe = venv / "bin" / "litellm"
    if exe.exists() and run([str(venv / "bin" / "python"), "-c", "import litellm.proxy.proxy_server"]).returncode == 0:
        return venv
    if not install:
        raise RuntimeError(f"no LiteLLM {LITELLM_VERSION} venv at {venv} (run without --no-install)")
    say(f"making LiteLLM's venv at {venv} (pip install 'litellm[proxy]=={LITELLM_VERSION}'; a minute or two)")
    base.mkdir(parents=True, exist_ok=True)
    for argv in (
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"],
    ):
        result = run(argv)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return venv


def module_version(python: str, module: str) -> str:
    result = run([python, "-c", f"import importlib.metadata as m; print(m.version({module!r}))"])
    return result.stdout.strip() if result.returncode == 0 else "-"


def importable(python: str, module: str) -> bool:
    return run([python, "-c", f"import {module}"]).returncode == 0


# --- llmgw: a real instance, set up from nothing ---------------------------------------------------------


def setup_child(upstream_port: int, parallel: int = 256, rollout: float = 0.0) -> None:
    """In a child with LLMGW_HOME and friends set: the rows the gateway routes by, the model's replica taking
    `parallel` requests at once (with `rollout`, a second replica on the same engine, a canary of a rollout
    watching at that share). Prints the engine key."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    import django

    django.setup()
    from django.utils import timezone

    from cluster.models import ClusterSettings, EngineVersion, Model, ModelFile, Node, Profile, Replica

    gib = 1024**3
    now = timezone.now()
    cluster = ClusterSettings.load()  # makes the engine key, as a real cluster has one
    engine = EngineVersion.objects.get(name="xllamacpp")  # from migration 0002
    # bench/gateway.py: slots for every concurrency measured, so admission admits each request at once (what it
    # costs, not a queue); bench/admission.py: the fake engine's own slots
    profile = Profile.objects.create(name="bench", parallel=parallel)
    file = ModelFile.objects.create(
        sha256=hashlib.sha256(b"bench/gateway.py").hexdigest(), name="bench.gguf", size=gib, format="gguf", gguf={}
    )
    node = Node.objects.create(
        name="bench-node", token_hash=Node.hash_token(Node.new_token()), address="127.0.0.1",
        facts={"cpu_count": os.cpu_count(), "memory_bytes": 16 * gib, "gpus": [], "engines": {"xllamacpp": ""},
               "port_range": [upstream_port, upstream_port], "hostname": socket.gethostname()},
        memory_bytes=16 * gib, connected=True, last_seen=now,
    )
    model = Model.objects.create(name=MODEL, file=file, engine=engine, profile=profile, replicas=1, memory_bytes=gib)
    snapshot = {"profile": profile.name, "args": profile.args(), "engine": engine.spec(), "file": file.sha256,
                "engine_key": ClusterSettings.fingerprint(cluster.engine_key)}
    Replica.objects.create(name=Replica.new_name(MODEL), model=model, node=node, state=Replica.State.READY,
                           port=upstream_port, memory_bytes=gib, state_changed_at=now, snapshot=snapshot)
    if rollout:  # (a commit before rollouts, as --baseline-tree, routes by the two replicas alike)
        from cluster.models import Rollout

        canary = Rollout.objects.create(model=model, actor="bench", traffic=rollout, change={"file": ["a", "b"]})
        Replica.objects.create(name=Replica.new_name(MODEL), model=model, node=node, state=Replica.State.READY,
                               port=upstream_port, memory_bytes=gib, state_changed_at=now, snapshot=snapshot,
                               rollout=canary)
    print(RESULT_MARK + json.dumps({"engine_key": cluster.engine_key}), flush=True)


def setup_llmgw(home: Path, env: dict, upstream_port: int, parallel: int = 256, rollout: float = 0.0
                ) -> tuple[str, str]:
    """migrate, the rows (the replica taking `parallel` requests at once), a client key: (engine key, client key)."""
    py = sys.executable
    manage = str(ROOT / "manage.py")
    steps = [
        ("migrate", [py, manage, "migrate", "--no-input", "-v", "0"]),
        ("rows", [py, str(ROOT / "bench" / "gateway.py"), "--setup-llmgw", str(upstream_port),
                  "--setup-parallel", str(parallel), "--setup-rollout", str(rollout)]),
        ("key", [py, manage, "llmgw", "ctl", "keys", "create", "bench"]),
    ]
    out = {}
    for name, argv in steps:
        result = run(argv, env=env, cwd=ROOT)
        if result.returncode != 0:
            raise RuntimeError(f"llmgw setup step {name} failed ({' '.join(argv)}):\n{result.stdout}\n{result.stderr}")
        out[name] = result.stdout
    said = next(json.loads(line[len(RESULT_MARK):]) for line in out["rows"].splitlines() if line.startswith(RESULT_MARK))
    engine_key = said["engine_key"]
    match = re.search(r"(sk-\S+)\s*$", out["key"].strip())
    if not match:
        raise RuntimeError(f"no key in the output of `ctl keys create`: {out['key']!r}")
    return engine_key, match.group(1)


# --- nginx and LiteLLM configs --------------------------------------------------------------------------


def nginx_conf(workdir: Path, port: int, upstream_port: int) -> Path:
    return harness.nginx_conf(workdir / "nginx", f"""    upstream engine {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}""", connections=4096)


def litellm_config(workdir: Path, upstream_port: int, engine_key: str, master_key: str) -> Path:
    path = workdir / "litellm.yaml"
    path.write_text(
        f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{upstream_port}/v1
      api_key: {engine_key}
general_settings:
  master_key: {master_key}
litellm_settings:
  telemetry: false
"""
    )
    return path


# --- the table ------------------------------------------------------------------------------------------
