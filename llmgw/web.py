"""How a web process is started: the one ASGI application under uvicorn (the default) or daphne.

Both serve everything (dashboard, REST API, gateway, agent and browser websockets). uvicorn, with uvloop and
httptools, is the default for two measured reasons: it is the faster gateway (bench/gateway.py: about 1.5x
daphne's requests per second and half its added latency), and it stops gracefully (on SIGTERM it stops
accepting, lets the requests in flight finish with `Connection: close`, then exits), so a restarted web
process loses no request; daphne cuts the connections it holds. daphne, the server llmgw was first designed on, stays
supported: `LLMGW_WEB_SERVER=daphne` or `llmgw up --server daphne`. Either, told to stop, finishes the gateway's
books before it exits (gateway.runtime.lifespan): uvicorn says the ASGI lifespan's shutdown once it has answered
its last request; daphne has no lifespan, and this module's daphne says it once daphne has ended its requests.
"""

from __future__ import annotations

import asyncio
import importlib
import os
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
    if server not in SERVERS:
        raise ValueError(f"unknown web server {server!r}: choose {' or '.join(SERVERS)}")
    # llmgw.web's own uvicorn, for its protocol (llmgw/uvicorn_limits.py: header and body timeouts, a connection
    # limit) and its graceful stop. With a descriptor, not uvicorn's own --fd, which takes every descriptor for a
    # UNIX socket: uvloop then never sets TCP_NODELAY on the connections, and each answer written in two parts
    # waits out the client's delayed ACK (40 ms a request). llmgw.web's daphne, for the lifespan's shutdown
    where = ["--fd", str(fd)] if fd is not None else ["--host", host, "--port", str(port)]
    return [py, "-m", "llmgw.web", *where, *(["--server", "daphne"] if server == "daphne" else [])]


def uvicorn_config(host: str = "127.0.0.1", port: int = 8000):
    """The uvicorn configuration of every web process: uvloop, httptools, the `websockets` library; the ASGI
    lifespan on (at its shutdown, once the last request is answered, the gateway finishes its books:
    gateway.runtime.lifespan); no access log. No per-message deflate on websockets: the agents' and dashboards'
    messages are small, and each stream's zlib state cost the web process about 0.1 MiB (500 agents: 284 →
    219–232 MiB, bench/fleet.py) and CPU on every message."""
    import uvicorn

    return uvicorn.Config(APPLICATION, host=host, port=port, loop="uvloop", http="httptools", lifespan="on",
                          access_log=False, ws="websockets", ws_per_message_deflate=False)


SETTLE = 0.25  # seconds a stopping web process waits, no longer accepting, for requests on its newest connections


def graceful_server(config, limits):
    """A uvicorn server whose connections are held to `limits` (`llmgw.uvicorn_limits.Limits`: header, body and
    keep-alive timeouts, a connection limit), and which stops as uvicorn does, but for two things, so that a web
    process that stops while other processes go on serving its socket loses no request:

    - uvicorn closes, the moment it stops accepting, every connection without a request under way: one that
      has just been accepted and not yet sent its request, or a kept-alive one whose client is sending its next
      request in that instant; either client gets no answer. This one first stops accepting (the kernel hands
      new connections to the others), waits `SETTLE` seconds, and only then closes the connections that had
      nothing under way all that while.
    - every request that begins once the stop has begun is answered with `Connection: close`, so its client
      goes on over a new connection (to another process) instead of sending its next request on one about to
      be closed.

    What is left is what any HTTP/1.1 server has: a connection idle for the whole settle whose client sends on
    it just as it is closed (RFC 9112, 9.3.1: clients retry such a request; the `openai` client does by default)."""
    import asyncio

    import uvicorn

    from llmgw.uvicorn_limits import protocol

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            self.server_state.stopping = True  # type: ignore[attr-defined]  # ours: uvicorn_limits reads it
            for server in self.servers:
                server.close()
            for connection in list(self.server_state.connections):  # under way: this answer is its last
                cycle = getattr(connection, "cycle", None)
                if cycle is not None and not cycle.response_complete:
                    cycle.keep_alive = False
            await asyncio.sleep(SETTLE)
            await super().shutdown(sockets)

    limits = limits.within_descriptors()
    config.http = protocol(limits)  # `limits`, and the `Connection: close` above
    config.timeout_keep_alive = limits.keepalive_timeout
    return Server(config)


def serve(fd: int | None = None, host: str = "", port: int = 0) -> None:
    """uvicorn (`graceful_server`, `uvicorn_config`, the limits of the settings) on the listening socket this
    process inherited as `fd`, its family read from the descriptor itself, or binding host:port as uvicorn's
    own command line would."""
    import socket

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")  # what the application loads anyway
    # the application before anything reads the settings: they see it loading (`WEB_PROCESS`), so this process
    # keeps its pool of PostgreSQL connections; read first by the limits, they made every agent's report open a
    # connection of its own (bench/fleet.py at 500 agents: all connected 14-15 s, add -> ready 47-56 s)
    importlib.import_module(APPLICATION.partition(":")[0])  # as uvicorn will, by its name
    from llmgw.uvicorn_limits import Limits

    config = uvicorn_config(host, port)
    server = graceful_server(config, Limits.from_settings())
    server.run(sockets=[socket.socket(fileno=fd)] if fd is not None else None)


async def said_stopping(application) -> None:
    """The ASGI lifespan's startup and shutdown, said to `application` at once: what a server without a lifespan
    of its own (daphne) says as it stops, for the application to finish what it must (the gateway's books)."""
    said = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

    async def receive() -> dict:
        return next(said)

    async def send(message: dict) -> None:
        pass

    await application({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}},
                      receive, send)


def serve_daphne(fd: int | None = None, host: str = "", port: int = 0) -> None:
    """daphne's own command line, on the inherited socket `fd` or binding host:port, and the ASGI lifespan's
    shutdown said once daphne has ended the requests it held (its `kill_all_applications`, what it does as it
    stops): a web process under daphne finishes the gateway's books as one under uvicorn does."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    from daphne.cli import CommandLineInterface  # first: it installs Twisted's asyncio reactor
    from daphne.server import Server
    from twisted.internet import defer

    class Stopping(Server):
        def kill_all_applications(self):
            killed = super().kill_all_applications()
            return killed.addCallback(lambda _: defer.Deferred.fromFuture(
                asyncio.ensure_future(said_stopping(self.application))))

    cli = CommandLineInterface()
    cli.server_class = Stopping
    # daphne closes every websocket after a day unless told otherwise; an agent's is long-lived by design. It has
    # no header or body timeout nor a connection limit (docs/security.md): those are uvicorn's here
    where = ["--fd", str(fd)] if fd is not None else ["-b", host, "-p", str(port)]
    cli.run(["--websocket_timeout", "-1", *where, APPLICATION])


def serve_workers(host: str, port: int, workers: int, server: str | None = None) -> None:
    """`workers` web processes on one listening socket this process holds, each started again when it exits
    (told to by `llmgw restart`, say): while one is on its way back, its connections wait in the socket's
    backlog instead of being refused. What the systemd unit runs for `service install --web-workers N`."""
    import signal
    import socket

    from llmgw.processes import Child, Supervisor, exit_said

    listener = socket.create_server((host, port), backlog=1024)
    listener.set_inheritable(True)
    fd = listener.fileno()
    stopping = {"flag": False}

    def on_signal(signum, frame):
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children = [Child(f"web-{i + 1}", web_argv(host, port, server, fd=fd), None, pass_fds=(fd,)) for i in range(workers)]
    supervisor = Supervisor(on_exit=lambda child, code, delay: print(exit_said(child, code, delay), flush=True))
    for child in children:
        supervisor.watch(child.start())
    print(f"{workers} web process(es) on {host}:{port}", flush=True)
    supervisor.run(lambda: stopping["flag"])
    for child in children:  # all at once: each finishes the requests it holds
        supervisor.forget(child)
        child.send(signal.SIGTERM)
    for child in children:
        child.stop()
    listener.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="web processes: on an inherited socket (--fd), or several on one")
    parser.add_argument("--fd", type=int, help="serve the listening socket inherited as this descriptor")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=None,
                        help="run this many web processes on one socket this process holds (else serve it here)")
    parser.add_argument("--server", choices=SERVERS, default=None,
                        help="daphne, or uvicorn (the default here; with --workers: LLMGW_WEB_SERVER)")
    args = parser.parse_args()
    if args.fd is not None or args.workers is None:
        if args.server == "daphne":
            serve_daphne(args.fd, args.host, args.port)
        else:
            serve(args.fd, args.host, args.port)
    else:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")  # the settings name the default server
        serve_workers(args.host, args.port, args.workers, args.server)
