"""How a web process is started: the one ASGI application under uvicorn (the default) or daphne.

Both serve everything (dashboard, REST API, gateway, agent and browser websockets). uvicorn, with uvloop and
httptools, is the default for two measured reasons: it is the faster gateway (bench/gateway.py: about 1.5x
daphne's requests per second and half its added latency), and it stops gracefully (on SIGTERM it stops
accepting, lets the requests in flight finish with `Connection: close`, then exits), so a restarted web
process loses no request; daphne cuts the connections it holds. daphne, the server DESIGN.md names, stays
supported: `LLMGW_WEB_SERVER=daphne` or `llmgw up --server daphne`.
"""

from __future__ import annotations

import sys

from django.conf import settings

SERVERS = ("uvicorn", "daphne")
APPLICATION = "llmgw.asgi:application"


def web_argv(host: str, port: int, server: str | None = None, python: str | None = None, fd: int | None = None) -> list[str]:
    """The web process's command line. With `fd`, it serves the listening socket it inherits as that file
    descriptor (what `llmgw up` does, so that a restarted web process takes over the same socket and no
    connection is refused in between), else it binds host:port itself."""
    server = server or settings.LLMGW_WEB_SERVER
    py = python or sys.executable
    if server == "daphne":
        where = ["--fd", str(fd)] if fd is not None else ["-b", host, "-p", str(port)]
        return [py, "-m", "daphne", *where, APPLICATION]
    if server == "uvicorn":
        where = ["--fd", str(fd)] if fd is not None else ["--host", host, "--port", str(port)]
        # lifespan off: the application has no startup or shutdown hooks (channels answers no lifespan scope)
        return [py, "-m", "uvicorn", *where, "--loop", "uvloop", "--http", "httptools",
                "--ws", "websockets", "--lifespan", "off", "--no-access-log", APPLICATION]
    raise ValueError(f"unknown web server {server!r}: choose {' or '.join(SERVERS)}")
